"""What a round sends between the app's nodes, and what crossing nodes adds to it.

  python scripts/cross_node.py --tiny              # both phases on the tiny pair
  python scripts/cross_node.py --phase bytes       # the real default pair, bytes only

A script, not a fly_bench module: it counts the rows as the serving side's own wire protocol
(deployments/parts/row_history.py) compacts them, and fly_bench imports nothing of the serving layer.

Phase "bytes" (no Ray): the engine in this process with its drafter and target behind a wire that
pickles what the Serve app's calls carry (a pickle is what Ray sends for these objects; tensors as
buffers): the rows as the ingress sends them (each row's new tokens only after its first call:
deployments/parts/row_history.py's RowSender compacts them),
the drafts back, the rows and drafts to the target, the verdict back. Per round, greedy and
sampled rows (a sampled row's drafts carry the drafter's distribution q [k, vocab] each: the
"logits" that cross).

Phase "latency": `python -m deployments.local_cluster` as a child process twice, deployments/
cpu-multinode.yaml unchanged: three nodes (ingress, target, drafter, every call between nodes)
and one node holding all their resources (every call within one node). The same requests one at
a time; /v1/fly/stats's timeline gives each round's draft and verify call time and the compute
the replicas report, so call - compute is the transport, per round.

The projection to a real network (marked as such in the output): per round, two calls, each one
round trip plus its bytes at the link's rate, from --rtt-ms and --gbps.
"""

import argparse
import json
import pickle
import sys

from deployments.parts.row_history import RowSender
from fly_bench.prompts import COMPLETIONS as PROMPTS
from loadtest.client import complete, stats
from loadtest.server import ClusterProcess

START_TIMEOUT_S = 600.0


def wire_bytes(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


class Wire:
    """A part behind a call: what goes and comes back is counted in bytes, the rows compacted as
    the remote parts send them (only tokens the other side does not hold)."""

    def __init__(self, part, sent: dict, name: str):
        self.part, self.sent, self.name = part, sent, name
        self.rows = RowSender()  # what the other side holds of each row, as the remote parts track it

    def __getattr__(self, attr):  # everything but the calls: the part's own (vocab_size, caches...)
        return getattr(self.part, attr)

    def _count(self, key: str, n: int) -> None:
        self.sent[key] = self.sent.get(key, 0) + n

    def propose(self, rows):
        self._count(f"to_{self.name}", wire_bytes(self.rows.compact(rows)))
        out = self.part.propose(rows)
        self._count(f"from_{self.name}", wire_bytes(out))
        self.rows.sent(rows)
        return out

    def verify(self, rows, drafts):
        self._count(f"to_{self.name}", wire_bytes((self.rows.compact(rows), drafts)))
        out = self.part.verify(rows, drafts)
        self._count(f"from_{self.name}", wire_bytes(out))
        self._count("rounds", 1)
        self.rows.sent(rows)
        return out

    def release(self, keys):
        self.rows.forget(keys)
        self.part.release(keys)


def bytes_per_round(tiny: bool, batches: list[int], max_tokens: int) -> dict:
    from fly_serve.build import build_engine

    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024) if tiny else build_engine()
    out = {}
    for temperature in (0.0, 0.7):
        for batch in batches:
            sent: dict = {}
            engine.scorer = Wire(engine.scorer, sent, "target")
            engine.drafters["model"] = Wire(engine.drafters["model"], sent, "drafter")
            params = {"mode": "fly", "k": 8, "max_tokens": max_tokens, "temperature": temperature, "seed": 1}
            engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], [params] * batch)
            engine.scorer, engine.drafters["model"] = engine.scorer.part, engine.drafters["model"].part
            rounds = max(sent.pop("rounds", 0), 1)
            per_round = {k: round(v / rounds) for k, v in sorted(sent.items())}
            out[f"t{temperature}_b{batch}"] = per_round | {"rounds": rounds, "total": sum(per_round.values())}
    return out


def start_cluster(tiny: bool, one_node: bool) -> ClusterProcess:
    cluster = ClusterProcess(0, ["--tiny"] * tiny + ["--one-node"] * one_node)
    if not cluster.ready(START_TIMEOUT_S):
        print("\n".join(cluster.lines[-40:]), file=sys.stderr)
        cluster.stop(120)
        raise RuntimeError("the local cluster did not become ready")
    return cluster


def round_transport(url: str, requests_n: int, max_tokens: int) -> dict:
    """Mean seconds per round by phase over requests sent one at a time (after a warm-up)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "fly": {"mode": "fly", "k": 8, "theta": 1.0}}

    def send(prompt: str) -> None:
        got = complete(url, {**body, "prompt": prompt}, timeout_s=300)
        if got.kind != "ok":
            raise RuntimeError(f"a request failed: {got.detail}")

    send(PROMPTS[0])  # warm-up
    before = stats(url, timeout_s=30)
    for i in range(requests_n):
        send(PROMPTS[i % len(PROMPTS)])
    after = stats(url, timeout_s=30)
    rounds = after["rounds"] - before["rounds"]
    # the timeline is a mean over all rounds since start: back to totals, minus the warm-up's
    mean = {
        k: (after["timeline"][k] * after["rounds"] - before["timeline"][k] * before["rounds"]) / max(rounds, 1)
        for k in ("draft_call", "draft_compute", "verify_call", "verify_compute")
    }
    ms = {k: round(v * 1e3, 3) for k, v in mean.items()}
    ms["draft_transport"] = round(ms["draft_call"] - ms["draft_compute"], 3)
    ms["verify_transport"] = round(ms["verify_call"] - ms["verify_compute"], 3)
    return {"rounds": rounds, "ms_per_round": ms}


def latency(tiny: bool, requests_n: int, max_tokens: int) -> dict:
    out = {}
    for layout, one_node in (("one_node", True), ("three_nodes", False)):
        cluster = start_cluster(tiny, one_node)
        try:
            out[layout] = round_transport(cluster.url, requests_n, max_tokens)
        finally:
            cluster.stop(120)  # SIGTERM: the launcher stops every node; then its whole group
    added = {
        k: round(out["three_nodes"]["ms_per_round"][k] - out["one_node"]["ms_per_round"][k], 3)
        for k in ("draft_transport", "verify_transport")
    }
    return out | {"added_ms_per_round": added}


def projection(per_round_bytes: dict, rtt_ms: float, gbps: float) -> dict:
    """PROJECTION, not a measurement: per round, two calls (drafter, target), each one round trip
    plus its bytes at the link's rate."""
    ms = {case: round(2 * rtt_ms + b["total"] * 8 / (gbps * 1e9) * 1e3, 3) for case, b in per_round_bytes.items()}
    return {"note": "projection, not measured", "rtt_ms": rtt_ms, "gbps": gbps, "added_ms_per_round": ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--phase", choices=["bytes", "latency", "both"], default="both")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rtt-ms", type=float, default=0.2, help="the projection's round trip (same zone)")
    p.add_argument("--gbps", type=float, default=10.0, help="the projection's link rate")
    a = p.parse_args(argv)
    out: dict = {"tiny": a.tiny}
    if a.phase in ("bytes", "both"):
        out["bytes_per_round"] = bytes_per_round(a.tiny, a.batches, a.max_tokens)
        out["projection"] = projection(out["bytes_per_round"], a.rtt_ms, a.gbps)
    if a.phase in ("latency", "both"):
        out["latency"] = latency(a.tiny, a.requests, a.max_tokens)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
