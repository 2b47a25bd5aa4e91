"""Folded attention against SDPA's grouped heads, whole forwards of the engine's own parts.

    python -m fly_bench.oneoff.folded_attention --out bench_out/folded

On a CPU a forward of up to runner.FOLD_TOKENS tokens a row folds its query heads onto their KV
head (runner.fold_queries); this times the default pair's target and drafter forwards both ways
(Runner.fold on and off), B rows of random contexts of the given lengths, T new tokens a row
(a decode step, verifications, drafting), the two ways taking turns pass by pass so that the
host's drift reaches both alike; medians of the passes. Nothing is asserted.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fly_serve.build import build_engine

SHAPES = [(1, 300, 300), (8, 250, 350), (8, 900, 1000)]  # (rows, shortest and longest context)


def forward_s(runner, keys: list[str], contexts: list[list[int]], T: int, gen: torch.Generator) -> float:
    """One forward of T fresh tokens a row after its context (the tokens before roll back)."""
    tokens = [c + torch.randint(1000, (T,), generator=gen).tolist() for c in contexts]
    t0 = time.perf_counter()
    runner.feed(keys, tokens, tail=[T] * len(keys))
    return time.perf_counter() - t0


def time_part(name: str, runner, widths: list[int], passes: int, gen: torch.Generator) -> list[dict]:
    out = []
    for B, lo, hi in SHAPES:
        lengths = torch.randint(lo, hi + 1, (B,), generator=gen).tolist()
        contexts = [torch.randint(1000, (n,), generator=gen).tolist() for n in lengths]
        keys = [f"fold-{name}-{B}-{lo}-{b}" for b in range(B)]
        runner.feed(keys, contexts, logits=False)
        for T in widths:
            took = {True: [], False: []}
            for p in range(passes):
                for fold in (True, False) if p % 2 else (False, True):
                    runner.fold = fold
                    took[fold].append(forward_s(runner, keys, contexts, T, gen))
            folded, grouped = (round(statistics.median(took[f]) * 1e3, 1) for f in (True, False))
            shape = {"part": name, "rows": B, "context": [lo, hi], "tokens": T}
            out.append(shape | {"folded_ms": folded, "grouped_ms": grouped})
            print(f"{name}, {B} rows of {lo}-{hi} keys, {T} tokens a row: folded {folded} ms, grouped {grouped} ms")
        runner.release(keys)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = build_engine(dtype="auto", drafter_precision="int8", max_batch=8)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, runner in (("target", engine.scorer.runner), ("drafter", engine.drafters["model"].runner)):
        fold = runner.fold
        if not fold:
            print(f"{name}: no folding here (a GPU, or no grouped KV heads)")
            continue
        rows += time_part(name, runner, args.tokens, args.passes, gen)
        runner.fold = fold
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
