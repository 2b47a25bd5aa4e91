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
import subprocess
import sys
import time
from pathlib import Path

from fly_serve.runtime.tp import free_port

from .procs import replica_pids
from .server import ClusterProcess
from .waits import Watch, until

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 900.0
SAMPLE_S = 0.5


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
    args = ["--tiny"] * a.tiny + ["--deployments", json.dumps({"FlyDrafter": {"autoscaling_config": pool}})]
    args += ["--add", f"drafter_1gpu={a.drafter_nodes - 1}"] if a.drafter_nodes > 1 else []
    cluster = ClusterProcess(free_port(), args)
    counter = None
    summary: dict = {"tiny": a.tiny, "method": a.method, "drafter_nodes": a.drafter_nodes, "pool": pool, "levels": []}
    try:
        if not cluster.ready(START_TIMEOUT_S):
            print("\n".join(cluster.lines[-40:]), file=sys.stderr)
            return 1
        counter = Watch(lambda: len(replica_pids(cluster.pid, "FlyDrafter")), SAMPLE_S, t0)  # drafter replicas
        for users in a.users:
            start = time.monotonic() - t0
            row = sweep_level(cluster.url, users, a, out)
            level = {"users": users, "t0_s": round(start, 1), "t1_s": round(time.monotonic() - t0, 1)}
            summary["levels"].append(level | {k: row.get(k) for k in ("tokens_per_s", "p50_latency_s", "failures")})
        # idle: the pool back to its minimum
        until(lambda: True if counter.changes[-1][1] <= pool["min_replicas"] else None, pool["downscale_delay_s"] + 60)
    finally:
        if counter is not None:
            counter.close()
            changes = counter.changes + [(time.monotonic() - t0, counter.changes[-1][1])] * bool(counter.changes)
            summary["drafter_replicas"] = [(round(t, 2), n) for t, n in changes]
        cluster.stop(120)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = plot(summary, out / "cluster_sweep.png")
    for level in summary["levels"]:
        print(json.dumps(level))
    print(f"wrote {out / 'summary.json'}" + (f" and {out / 'cluster_sweep.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
