"""One local Ray + Serve per test module, tiny models, traffic to 127.0.0.1 only."""

import os
from pathlib import Path

from fly_serve.runtime.tp import free_port

ROOT = Path(__file__).resolve().parent.parent


def start_serve(app_args: dict, name: str = "fly"):
    """Starts Ray (4 logical CPUs on this 2-core box; replicas ask for fractions) and runs the
    app; returns the base URL once its /healthz answers 200. Workers import `deployments` and
    `fly_serve` through PYTHONPATH; the HTTP proxy runs its guard with the app's body bounds, as
    `fly-serve serve` starts it."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    from deployments.launch import proxy_bounds
    from deployments.profiles.app_args import AppArgs

    os.environ.update(proxy_bounds([AppArgs.model_validate(app_args)]))
    import ray
    from ray import serve

    from deployments.app import build

    # address "local": a Ray of its own, never a cluster another process on this machine started
    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(app_args), name=name, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)  # the app RUNNING in Serve's status is not yet the proxy routing to it
    return base


def running(deployment: str, app: str = "fly") -> int:
    """Replicas of a deployment Serve reports RUNNING."""
    from ray import serve

    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def per_replica(deployment: str, method: str, n: int, app: str = "fly") -> list:
    """`method` on each of n replicas: a call tagged g<i> goes to the i-th (routing/replica_pool.PinnedRouter)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    return [getattr(handle.options(multiplexed_model_id=f"g{i}"), method).remote().result() for i in range(n)]


def wait_ready(url: str, timeout_s: float = 240) -> dict:
    """Until the app's /healthz answers 200; returns its body. A refused connection, a timeout or
    the proxy's own answer while it still learns the routes (not our JSON) is waited out: a slow
    machine shows them at start. Our own (JSON) answer before then must be a 503 saying it is
    loading or draining: never unhealthy, never a 500."""
    import time

    import requests

    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            r = requests.get(f"{url}/healthz", timeout=10)
        except requests.RequestException as e:
            last = repr(e)
        else:
            try:
                body = r.json()
            except ValueError:
                body = None  # the proxy's plain text
            if isinstance(body, dict):  # our app's answer
                if r.status_code == 200:
                    return body
                assert r.status_code == 503 and body.get("status") in ("loading", "draining"), r.text
            last = f"{r.status_code} {r.text[:200]}"
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {timeout_s:.0f} s; last answer: {last}")


def stop_serve():
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
