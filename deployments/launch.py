"""`fly-serve serve`: a local Ray, the Serve config deployed as `serve run <config>` would,
a line when the API answers, then block until SIGTERM or Ctrl-C.

Stopping is graceful: the first SIGTERM / SIGINT asks each application's ingress to stop
admitting (`drain`: new requests get 503), waits up to --grace-s until no request is in flight,
and only then shuts Serve down. The order matters: Serve's own shutdown kills its HTTP proxies at
once, so whatever is still in flight then loses its connection. A second signal skips the wait.
The exit status is 0 either way.
"""

import argparse
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from deployments.http import proxy_guard
from deployments.profiles.app_args import AppArgs

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "deployments" / "profiles" / "cpu-default.yaml"
GRACE_S = 30.0  # --grace-s when the config sets no graceful_shutdown_timeout_s
# After the replicas finish a response, the proxy may still be writing its last bytes.
SETTLE_S = 1.0
POLL_S = 0.5


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fly-serve serve", description="Serve the OpenAI-compatible API on Ray Serve.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config YAML (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tiny", action="store_true", help="tiny random models (starts in seconds; for smoke tests)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs for the local Ray (default: all)")
    p.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help="on SIGTERM, how long in-flight requests may take to finish (default: the config's largest "
        f"graceful_shutdown_timeout_s, else {GRACE_S:g})",
    )
    return p.parse_args(argv)


def load_config(path: str, host: str, port: int, tiny: bool):
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text())
    raw["http_options"] = {**raw.get("http_options", {}), "host": host, "port": port}
    if tiny:
        for app in raw["applications"]:
            app.setdefault("args", {})["tiny"] = True
    return ServeDeploySchema.model_validate(raw)


def config_grace_s(config) -> float:
    """The longest graceful_shutdown_timeout_s the config gives a deployment: the profile says how
    long its requests may take, and the launcher's wait should not cut them shorter."""
    timeouts = [
        d.graceful_shutdown_timeout_s
        for app in config.applications
        for d in app.deployments
        if isinstance(d.graceful_shutdown_timeout_s, int | float)
    ]
    return max(timeouts, default=GRACE_S)


class StopSignals:
    """SIGTERM and SIGINT: the first asks for a graceful stop, a second to stop waiting."""

    def __init__(self):
        self.requested, self.hurry = threading.Event(), threading.Event()
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        (self.hurry if self.requested.is_set() else self.requested).set()


def wait_ready(url: str, stop: threading.Event | None = None, timeout_s: float = 1800) -> bool:
    """Until /healthz answers 200 (the first start may convert the weights: a minute or more);
    False past timeout_s or once a stop is asked for."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        stop.wait(2)
    return False


def stop_admitting(app_names: list[str]) -> None:
    """Each ingress stops admitting: from then on it answers new requests 503 and serves the
    ones it has to their last byte."""
    from ray import serve

    for name in app_names:
        serve.get_app_handle(name).drain.remote().result(timeout_s=10)


def in_flight(app_names: list[str]) -> int | None:
    """Requests in flight at every ingress (None: one could not be asked; ask again)."""
    from ray import serve

    try:
        return sum(serve.get_app_handle(name).in_flight.remote().result(timeout_s=10) for name in app_names)
    except Exception:  # a replica going away mid-count: count again at the next poll
        return None


def drain(app_names: list[str], grace_s: float, hurry: threading.Event) -> int | None:
    """Stop admitting, then wait until nothing is in flight (at most grace_s, or until `hurry`);
    returns what is still in flight (None: unknown)."""
    deadline = time.monotonic() + grace_s
    try:
        stop_admitting(app_names)
    except Exception as e:  # an ingress that cannot be told still has its requests counted
        print(f"fly-serve: could not stop admitting ({type(e).__name__})", file=sys.stderr, flush=True)
    left = in_flight(app_names)
    while left != 0 and time.monotonic() < deadline and not hurry.is_set():
        hurry.wait(POLL_S)
        left = in_flight(app_names)
    if left == 0:
        hurry.wait(SETTLE_S)
    return left


def deploy_config(config) -> None:
    """Deploys a Serve config as `serve deploy` does. Ray Serve's public API deploys
    Applications (`serve.run`), not a config with per-deployment overrides; the CLI does that
    through the dashboard's REST API, which this launcher leaves off. So this one call uses
    Serve's internal client, the one the CLI's `serve run <config>` uses; pyproject.toml bounds
    ray[serve] to the versions this was tested with."""
    from ray.serve._private import api as serve_api

    client = serve_api.serve_start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location)
    client.deploy_apps(config, _blocking=False)


def prepare_environment(proxy: dict[str, str] | None = None) -> None:
    """What every Ray process this one starts inherits: no auth on a local Ray (an operator's
    value wins), this checkout on PYTHONPATH, so the replicas import its `deployments` and
    `fly_serve`, and the HTTP proxies' guard (http/proxy_guard.py) with `proxy`'s bounds
    (proxy_bounds; default: the app's defaults). An operator's own proxy hook wins, with a warning:
    its proxies then read bodies inside the replicas."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    wanted = proxy or proxy_bounds([AppArgs()])
    hook = os.environ.get(proxy_guard.PROXY_HOOK_ENV)
    if hook not in (None, "", proxy_guard.HOOK):
        print(
            f"fly-serve: {proxy_guard.PROXY_HOOK_ENV}={hook} is set: the proxy guard is off (slow request "
            "bodies are read inside the replicas)",
            file=sys.stderr,
            flush=True,
        )
        return
    os.environ.update(wanted)


def proxy_bounds(apps: list[AppArgs]) -> dict[str, str]:
    """The proxy guard's environment for these applications: the largest body and the longest
    body deadline any of them allows (each app's ingress checks its own again)."""
    apps = apps or [AppArgs()]
    return proxy_guard.environment(max(a.max_body_bytes for a in apps), max(a.body_timeout_s for a in apps))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop = StopSignals()  # before Ray starts: a SIGTERM during start-up also stops cleanly
    config = load_config(args.config, args.host, args.port, args.tiny)
    prepare_environment(proxy_bounds([AppArgs.model_validate(app.args or {}) for app in config.applications]))
    # Ray starts its workers at nice 15 to keep its own daemons responsive on a shared node; here
    # the workers are the service, and on a CPU node a niced target replica loses a core's share
    # to every waking daemon (its OMP threads then wait for each other). An operator's value wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Serve's own wake-ups, fewer: its controller runs its loop every 0.1 s and each replica and
    # proxy exports metrics every 0.1 s, and each wake-up on a small node preempts a thread of a
    # forward (an idle app's share of a core: docs/journal.md, "One OpenMP team"). The cost: the
    # controller reacts (scaling, replica states) up to 0.5 s later. An operator's value wins.
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
    # Ray's own bookkeeping that this app never reads, off or rarer: every actor call's task events
    # (the state API's task table; each streamed chunk is a call), the event loops' statistics, and
    # the dashboard agent's node report (a psutil walk of every process) every 30 s instead of 5.
    # The app's Prometheus metrics are unaffected. Measured on an idle tiny app: docs/journal.md,
    # "Ray's processes on 2 cores". An operator's value wins.
    os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
    os.environ.setdefault("RAY_event_stats", "0")
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "30000")
    import ray
    from ray import serve

    grace_s = config_grace_s(config) if args.grace_s is None else args.grace_s
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        namespace="serve",
        _node_ip_address="127.0.0.1",
    )
    stop.install()  # ray.init replaces the SIGTERM handler with an immediate exit
    deploy_config(config)
    url = f"http://{args.host}:{args.port}"
    print(f"fly-serve: deploying {args.config} ...", flush=True)
    status = 0
    if wait_ready(url, stop.requested):
        print(f"fly-serve: ready at {url}/v1 (Ctrl-C or SIGTERM stops)", flush=True)
        while not stop.requested.wait(1):
            pass
        print(f"fly-serve: stopping; in-flight requests have {grace_s:g} s to finish", flush=True)
        t0 = time.monotonic()
        left = drain([app.name for app in config.applications], grace_s, stop.hurry)
        waited = time.monotonic() - t0
        outcome = "nothing left in flight" if left == 0 else f"{'some' if left is None else left} still in flight"
        print(f"fly-serve: drained for {waited:.1f} s: {outcome}", flush=True)
    elif not stop.requested.is_set():
        print("fly-serve: the application did not become ready", file=sys.stderr)
        status = 1
    serve.shutdown()
    ray.shutdown()
    print("fly-serve: stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
