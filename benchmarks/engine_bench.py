"""Side-by-side speed of every mode on the default pair, in one run (one process, same prompt).

    python benchmarks/engine_bench.py --max-tokens 256 --out bench_out/engine.json

Speedups are ratios against `ar` measured in the same run; nothing here is asserted.
"""

import argparse
import json
import time

import torch

from fly_serve.build import build_engine
from fly_serve.loading import load_model, load_tokenizer
from fly_serve.prompts import chat_prompt
from fly_serve.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
    "given as a list of [start, end] pairs and returns them sorted. Include a docstring and "
    "a few doctest examples."
)


def run(engine, prompt, **params):
    req = engine.add(prompt, params)
    t0 = time.perf_counter()
    while not req.finished:
        engine.step()
    wall = time.perf_counter() - t0
    s = req.stats
    return dict(
        params,
        tokens=s.emitted,
        wall_s=round(wall, 2),
        tok_s=round(s.emitted / wall, 2),
        tau=round(s.tau, 2),
        rounds=s.rounds,
        loosely=s.loosely_accepted,
        draft_s=round(s.draft_s, 2),
        verify_s=round(s.verify_s, 2),
        decide_s=round(s.decide_s, 4),
        ids=req.generated,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, nargs="+", default=[10])
    ap.add_argument("--drafters", nargs="+", default=["int8", "bf16"])
    ap.add_argument(
        "--dtype", default="auto", help="target precision (auto: bf16 where the hardware has it, else fp32)"
    )
    ap.add_argument("--min-confidence", type=float, default=0.0, help="ModelDrafter.min_confidence")
    ap.add_argument("--extra", action="store_true", help="also theta / entropy / window variants")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, args.dtype)
    prompt = chat_prompt(tok, PROMPT)
    base = dict(max_tokens=args.max_tokens, temperature=0.0)
    results = []
    engine = build_engine(target, None, tokenizer=tok, max_batch=1)
    run(engine, prompt, mode="ar", max_tokens=8)  # warm-up
    ar = run(engine, prompt, mode="ar", **base)
    results += [dict(ar, drafter="-"), dict(run(engine, prompt, mode="pld", k=max(args.k), **base), drafter="-")]
    for precision in args.drafters:
        drafter = load_model(DEFAULT_DRAFTER, precision)
        engine = build_engine(target, drafter, tokenizer=tok, max_batch=1, draft_min_confidence=args.min_confidence)
        run(engine, prompt, mode="spd", k=4, max_tokens=8)  # warm-up
        for k in args.k:
            variants = [dict(mode="spd"), dict(mode="fly"), dict(mode="fly", mla=False), dict(mode="spd", mla=False)]
            if args.extra:
                variants += [
                    dict(mode="fly", theta=0.0),
                    dict(mode="fly", entropy="full"),
                    dict(mode="fly", window_rule="authors"),
                    dict(mode="fly", window=3),
                ]
            for v in variants:
                results.append(dict(run(engine, prompt, k=k, **v, **base), drafter=precision))
    for r in results:
        r["speedup"] = round(r["tok_s"] / ar["tok_s"], 2)
        same = sum(a == b for a, b in zip(r["ids"], ar["ids"]))
        r["prefix_equal_to_ar"] = next((i for i, (a, b) in enumerate(zip(r["ids"], ar["ids"])) if a != b), same)
        print(json.dumps({k: v for k, v in r.items() if k != "ids"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    print("\n--- text of the last fly run ---\n" + tok.decode(results[-1]["ids"]))


if __name__ == "__main__":
    main()
