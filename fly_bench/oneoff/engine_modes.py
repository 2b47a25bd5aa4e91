"""Side-by-side speed of every mode on the default pair, in one run (one process, same prompt:
prompts.CODE).

    python -m fly_bench.oneoff.engine_modes --max-tokens 256 --out bench_out/engine.json

Speedups are ratios against `ar` measured in the same run; nothing here is asserted.
"""

import argparse
import json

import torch

from fly_bench.prompts import CODE
from fly_bench.timing import timed_one
from fly_serve.build import build_engine
from fly_serve.engine.prompts import chat_prompt
from fly_serve.loading.loading import load_model, load_tokenizer
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET


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
    prompt = chat_prompt(tok, CODE)
    base = dict(max_tokens=args.max_tokens, temperature=0.0)
    engine = build_engine(target, None, tokenizer=tok, max_batch=1)
    timed_one(engine, prompt, mode="ar", max_tokens=8)  # warm-up
    ar = timed_one(engine, prompt, mode="ar", **base)
    results = [(ar, "-"), (timed_one(engine, prompt, mode="pld", k=max(args.k), **base), "-")]
    for precision in args.drafters:
        drafter = load_model(DEFAULT_DRAFTER, precision)
        engine = build_engine(target, drafter, tokenizer=tok, max_batch=1, draft_min_confidence=args.min_confidence)
        timed_one(engine, prompt, mode="spd", k=4, max_tokens=8)  # warm-up
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
                results.append((timed_one(engine, prompt, k=k, **v, **base), precision))
    rows = []
    for t, drafter in results:
        speedup, prefix = round(t.speedup_over(ar), 2), t.same_prefix(ar)
        rows.append(t.row(drafter=drafter, speedup=speedup, prefix_equal_to_ar=prefix, ids=t.ids))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "ids"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    print("\n--- text of the last fly run ---\n" + results[-1][0].text)


if __name__ == "__main__":
    main()
