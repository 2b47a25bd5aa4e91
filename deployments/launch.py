"""`fly-serve serve`: a local Ray, the Serve config deployed as `serve run <config>` would,
a line when the API answers, then block until Ctrl-C."""

import argparse
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "deployments" / "cpu-default.yaml"


def parse(argv):
    p = argparse.ArgumentParser(prog="fly-serve serve", description="Serve the OpenAI-compatible API on Ray Serve.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config YAML (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tiny", action="store_true", help="tiny random models (starts in seconds; for smoke tests)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs for the local Ray (default: all)")
    return p.parse_args(argv)


def load_config(path: str, host: str, port: int, tiny: bool):
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text())
    raw["http_options"] = {**raw.get("http_options", {}), "host": host, "port": port}
    if tiny:
        for app in raw["applications"]:
            app.setdefault("args", {})["tiny"] = True
    return ServeDeploySchema.model_validate(raw)


def wait_ready(url: str, timeout_s: float = 1800):
    """Until /healthz answers: the first start may convert the weights (a minute or more)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(2)
    return False


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # replicas import `deployments` and `fly_serve` from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray
    from ray.serve._private import api as serve_api

    config = load_config(args.config, args.host, args.port, args.tiny)
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        namespace="serve",
        _node_ip_address="127.0.0.1",
    )
    client = serve_api.serve_start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location)
    client.deploy_apps(config, _blocking=False)
    url = f"http://{args.host}:{args.port}"
    print(f"fly-serve: deploying {args.config} ...", flush=True)
    if not wait_ready(url):
        print("fly-serve: the application did not become ready", file=sys.stderr)
        return 1
    print(f"fly-serve: ready at {url}/v1 (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` shuts down like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
