"""The load sweep against the multi-node app: a local cluster of several raylets on 127.0.0.1
(`python -m deployments.local_cluster`, deployments/profiles/cpu-multinode.yaml: ingress on the head, the
TP=2 target on a target node, one drafter replica per drafter node) as a child process, then
loadtest.load_sweep at each user count in turn, while the drafter replicas (their processes under
the cluster's raylets) are counted every half second. Writes summary.json (each level's span,
tokens/s, latency; the replica counts over time) and, with matplotlib, cluster_sweep.png: drafter
replicas over time above each level's throughput over the same time.

    python -m loadtest.cluster_sweep --tiny --duration 10          # mechanics, minutes
    python -m loadtest.cluster_sweep --users 1 2 4 8 16 --drafter-nodes 3

The pool scales on the drafters' busy time (replica_pool.BusyPolicy); --busy-target sets the
fraction each replica should be busy (the profile's 0.6; a tiny drafter is never that busy, so
--tiny defaults to 0.01). Nothing is asserted; tests/test_multinode.py asserts the mechanics.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fly_serve.runtime.tp import free_port

from .procs import replica_pids
from .waits import until

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 900.0
SAMPLE_S = 0.5


class ClusterProcess:
    """`python -m deployments.local_cluster` in a session of its own (its raylets and their
    workers in its process group), its output collected."""

    def __init__(self, port: int, tiny: bool, drafter_nodes: int, pool: dict):
        argv = [sys.executable, "-m", "deployments.local_cluster", "--port", str(port)]
        argv += ["--tiny"] * tiny + ["--deployments", json.dumps({"FlyDrafter": {"autoscaling_config": pool}})]
        argv += ["--add", f"drafter_1gpu={drafter_nodes - 1}"] if drafter_nodes > 1 else []
        env = os.environ | {"RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.url, self.lines = f"http://127.0.0.1:{port}", []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def ready(self, timeout_s: float) -> bool:
        def seen():
            if any(line.startswith("local-cluster: ready") for line in self.lines):
                return True
            return False if self.proc.poll() is not None else None

        return bool(until(seen, timeout_s))

    def stop(self) -> None:
        """SIGTERM (the launcher stops every node), then its whole group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


class ReplicaCounter:
    """Drafter replica processes under the cluster, every SAMPLE_S, from its start."""

    def __init__(self, root_pid: int, t0: float):
        self.root_pid, self.t0 = root_pid, t0
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((round(time.monotonic() - self.t0, 2), len(replica_pids(self.root_pid, "FlyDrafter"))))
            self.stop.wait(SAMPLE_S)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def sweep_level(url: str, users: int, a, out: Path) -> dict:
    """One load_sweep run at `users`; its summary row."""
    argv = [sys.executable, "-m", "loadtest.load_sweep", "--host", url, "--users", str(users)]
    argv += ["--methods", a.method, "--duration", str(a.duration), "--max-tokens", str(a.max_tokens)]
    argv += ["--out", str(out / f"u{users}")]
    subprocess.run(argv, cwd=ROOT, check=True, timeout=a.duration * 20 + 600)
    return json.loads((out / f"u{users}" / "summary.json").read_text())[str(users)][a.method]


def plot(summary: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5))
    t, n = zip(*summary["drafter_replicas"]) if summary["drafter_replicas"] else ((), ())
    top.step(t, n, where="post")
    top.set_ylabel("drafter replicas")
    for level in summary["levels"]:
        bottom.hlines(level["tokens_per_s"], level["t0_s"], level["t1_s"], linewidth=3)
        bottom.annotate(f"{level['users']}u", (level["t0_s"], level["tokens_per_s"]), fontsize=8)
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("seconds since the cluster started")
    top.set_title(f"{summary['method']} on the multi-node app ({'tiny' if summary['tiny'] else 'default'} pair)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--method", default="fly:k=auto")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--drafter-nodes", type=int, default=3, help="drafter nodes (one replica each at most)")
    p.add_argument("--busy-target", type=float, default=None)
    p.add_argument("--out", default="loadtest/results/cluster_sweep")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pool = {
        "min_replicas": 1,
        "max_replicas": a.drafter_nodes,
        "upscale_delay_s": 2,
        "downscale_delay_s": 15,
        "metrics_interval_s": 1,
        "look_back_period_s": 5,
        "policy": {
            "policy_function": "deployments.routing.replica_pool:BusyPolicy",
            "policy_kwargs": {"target": a.busy_target or (0.01 if a.tiny else 0.6)},
        },
    }
    t0 = time.monotonic()
    cluster = ClusterProcess(free_port(), a.tiny, a.drafter_nodes, pool)
    counter = None
    summary: dict = {"tiny": a.tiny, "method": a.method, "drafter_nodes": a.drafter_nodes, "pool": pool, "levels": []}
    try:
        if not cluster.ready(START_TIMEOUT_S):
            print("\n".join(cluster.lines[-40:]), file=sys.stderr)
            return 1
        counter = ReplicaCounter(cluster.proc.pid, t0)
        for users in a.users:
            start = time.monotonic() - t0
            row = sweep_level(cluster.url, users, a, out)
            level = {"users": users, "t0_s": round(start, 1), "t1_s": round(time.monotonic() - t0, 1)}
            summary["levels"].append(level | {k: row.get(k) for k in ("tokens_per_s", "p50_latency_s", "failures")})
        time.sleep(pool["downscale_delay_s"] + 10)  # idle: the pool back to its minimum
    finally:
        if counter is not None:
            counter.close()
            summary["drafter_replicas"] = counter.samples
        cluster.stop()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = plot(summary, out / "cluster_sweep.png")
    for level in summary["levels"]:
        print(json.dumps(level))
    print(f"wrote {out / 'summary.json'}" + (f" and {out / 'cluster_sweep.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
