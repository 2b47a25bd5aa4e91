"""What a round costs outside the model's forwards: the host work a GPU still pays once the
forwards replay from CUDA graphs (docs/GPU.md, "Host cost of a round").

    python -m fly_bench.host_cost                       # batch 1 / 8 / 16, every kind of round
    python -m fly_bench.host_cost --context 3000 --kinds ar spd8 --batches 1 16

Tiny random models (the tests' pair: a 2-layer target, a 1-layer drafter, 259 tokens), one torch
thread. Per kind of round and batch, B requests run in steady state (prompts prefilled) and each
round is timed whole (`Engine.step`) and inside the models' forwards (`Runner.forward` of the
target and the drafter, timed from outside); outside = total - inside. Best of `--repeats` runs
of `--rounds` rounds (their mean), and the quickest single round (on a shared host the steadier
figure: noise only adds time). A last pass counts the host reads of device tensors per round
(host_reads.HostReads: what a GPU would make the host wait for). Both draft loops where the
engine has them (`--loops`): the MLA loop (drafters.ModelDrafter's) and the fixed-shape one
(fixed_loop.py). Kinds of round:

  ar     plain decoding (mode ar)
  k0     k "auto" with every row at k 0 (drafting priced out, no free drafts): rounds without a
         drafter forward (a probe's rounds are left out)
  free   the same with the rows' free drafts (prompt lookup, no drafter forward)
  spd4   spd, k 4      spd8  spd, k 8
  auto   fly k "auto", theta 1 (the served default), on the default cost shape

One JSON line per (kind, batch, loop), then a markdown table of the outside times and their ratio
to the ar step's of the same batch. Nothing is asserted.
"""

import argparse
import json
import time
from dataclasses import dataclass

import torch

from fly_bench.host_reads import HostReads, device_tensors
from fly_serve.build import build_engine
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer

KINDS = ("ar", "k0", "free", "spd4", "spd8", "auto")
# Drafting priced out (a drafter forward costs 100 target steps, width is free): k "auto" never
# runs the drafter, and drafts only what the rows' free sources propose.
PRICED_OUT = {
    "verify": {"tokens": [1, 64], "seconds": [0.01, 0.01]},
    "draft": {"per_round": 0.0, "per_forward": 1.0, "per_row_forward": 0.0},
}
AUTO = dict(mode="fly", k="auto", k_max=15, theta=1.0, window=6)
PARAMS = {
    "ar": dict(mode="ar"),
    "k0": dict(AUTO, mla=False),
    "free": dict(AUTO),
    "spd4": dict(mode="spd", k=4),
    "spd8": dict(mode="spd", k=8),
    "auto": dict(AUTO),
}


class ForwardClock:
    """Runner.forward of each runner timed from outside (instance attributes over the method)."""

    def __init__(self, runners: dict):
        self.seconds = 0.0
        self.calls = {name: 0 for name in runners}
        for name, runner in runners.items():
            if runner is not None:
                runner.forward = self._wrap(name, runner.forward)

    def _wrap(self, name, forward):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return forward(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls[name] += 1

        return timed

    def snapshot(self) -> tuple[float, dict]:
        return self.seconds, dict(self.calls)


@dataclass
class Round:
    total_s: float
    inside_s: float
    target: int  # target forwards
    drafter: int  # drafter forwards


def engine(context: int, batch: int, loop: str | None, profile: dict | None, max_tokens: int = 1200):
    """The tiny pair with room for `batch` rows of `context` + max_tokens tokens; loop: the draft
    loop knob (None: the engine's default, for an engine without the knob)."""
    n_pos = max(1024, context + max_tokens + 64)
    target = tiny_model(seed=0, max_position_embeddings=n_pos)
    drafter = tiny_model(seed=1, num_hidden_layers=1, max_position_embeddings=n_pos)
    knobs = dict(max_batch=batch, max_model_len=n_pos, kv_budget_tokens=batch * n_pos)
    if loop is not None:
        knobs["draft_loop"] = loop
    eng = build_engine(target, drafter, tokenizer=tiny_tokenizer(), speculation_profile=profile, progress=None, **knobs)
    eng.eos_ids = set()  # random models: every request runs to max_tokens
    if profile is not None:
        eng.policy.frozen = True  # the given profile prices every round (no cost check)
    return eng


def prompts(batch: int, context: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(context)
    return [torch.randint(0, 256, (context,), generator=g).tolist() for _ in range(batch)]


def measure(kind: str, batch: int, context: int, loop: str | None, rounds: int, repeats: int, reads: bool = True):
    """One (kind, batch, loop): the best repeat's per-round means, and the host reads per round."""
    profile = PRICED_OUT if kind in ("k0", "free") else None
    need = (2 + repeats + int(reads)) * rounds * 16 + 64
    eng = engine(context, batch, loop, profile, need)
    drafter = eng.drafters["model"]
    clock = ForwardClock({"target": eng.scorer.runner, "drafter": drafter.runner})
    for p in prompts(batch, context):
        eng.add(p, dict(PARAMS[kind], max_tokens=need))
    for _ in range(3):  # prefill and settle
        eng.step()
    assert len(eng.running) == batch, "every request runs"

    def run(n: int) -> list[Round]:
        out = []
        while len(out) < n:
            t_in, calls = clock.snapshot()
            t0 = time.perf_counter()
            eng.step()
            total = time.perf_counter() - t0
            t_in2, calls2 = clock.snapshot()
            d = Round(total, t_in2 - t_in, calls2["target"] - calls["target"], calls2["drafter"] - calls["drafter"])
            if kind in ("k0", "free") and d.drafter:  # a probe's round: not this kind
                continue
            out.append(d)
        return out

    best, quickest = None, float("inf")
    for _ in range(repeats):
        rs = run(rounds)
        outside = sum(r.total_s - r.inside_s for r in rs) / len(rs)
        quickest = min(quickest, *(r.total_s - r.inside_s for r in rs))
        if best is None or outside < best[0]:
            best = (outside, rs)
    outside, rs = best
    n = len(rs)
    row = dict(
        kind=kind,
        batch=batch,
        context=context,
        loop=loop or "default",
        total_ms=round(1000 * sum(r.total_s for r in rs) / n, 3),
        inside_ms=round(1000 * sum(r.inside_s for r in rs) / n, 3),
        outside_ms=round(1000 * outside, 3),
        quickest_outside_ms=round(1000 * quickest, 3),  # the quickest single round: robust to a busy host
        forwards=round(sum(r.target + r.drafter for r in rs) / n, 2),
        drafter_forwards=round(sum(r.drafter for r in rs) / n, 2),
    )
    if reads:
        row["host_reads"] = host_reads(eng, rounds)
    eng.fail_running("benchmark over")
    return row


def host_reads(eng, rounds: int) -> float:
    """Host reads of device tensors per round, over `rounds` rounds (host_reads.HostReads)."""
    drafter = eng.drafters["model"]
    counter = HostReads(device_tensors(eng.scorer.runner, getattr(drafter, "runner", None)))
    with counter:
        for _ in range(rounds):
            eng.step()
    return round(counter.count / rounds, 2)


def has_loop_knob() -> bool:
    from fly_serve.config import EngineConfig

    return "draft_loop" in EngineConfig.__dataclass_fields__


def table(rows: list[dict]) -> str:
    """Outside ms per round (x the ar step's of the same batch and loop), forwards, host reads."""
    ar = {(r["batch"], r["loop"], r["context"]): r["outside_ms"] for r in rows if r["kind"] == "ar"}
    lines = [
        "| kind | loop | batch | context | total ms | inside ms | outside ms | x ar | quickest outside ms | x ar |"
        " forwards | host reads |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    quick = {(r["batch"], r["loop"], r["context"]): r["quickest_outside_ms"] for r in rows if r["kind"] == "ar"}
    for r in rows:
        at = (r["batch"], r["loop"], r["context"])
        ratio = f"{r['outside_ms'] / ar[at]:.2f}" if ar.get(at) else ""
        q_ratio = f"{r['quickest_outside_ms'] / quick[at]:.2f}" if quick.get(at) else ""
        lines.append(
            f"| {r['kind']} | {r['loop']} | {r['batch']} | {r['context']} | {r['total_ms']:.2f} | "
            f"{r['inside_ms']:.2f} | {r['outside_ms']:.2f} | {ratio} | {r['quickest_outside_ms']:.2f} | {q_ratio} | "
            f"{r['forwards']} | {r.get('host_reads', '')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[100])
    ap.add_argument("--loops", nargs="+", default=None, help="mla, fixed (default: both where the engine has them)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-reads", action="store_true", help="skip the host-read count")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    loops = a.loops or (["mla", "fixed"] if has_loop_knob() else [None])
    rows = []
    for context in a.context:
        for batch in a.batches:
            for loop in loops:
                for kind in a.kinds:
                    if loop == "fixed" and kind in ("ar", "k0", "free") and "mla" in loops:
                        continue  # no drafter forward: the loops do not differ
                    row = measure(kind, batch, context, loop, a.rounds, a.repeats, reads=not a.no_reads)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if len(loops) > 1:  # the loop-free kinds, shown under both loops for the ratios
        rows += [dict(r, loop=lp) for r in rows if r["kind"] in ("ar", "k0", "free") for lp in loops[1:]]
    print(table(rows))


if __name__ == "__main__":
    main()
