"""How often greedy `spd` drifts from greedy `ar` in bf16 (and in fp32, as the control).

    python -m fly_bench.oneoff.bf16_drift --prompts 8 --max-tokens 64

A multi-token forward (verification) and a one-token forward (ar) give slightly different bf16
logits; where the target's top two tokens are near-tied the argmax can flip and the outputs part.
"""

import argparse
import json

from fly_bench.prompts import QUESTIONS
from fly_bench.timing import timed_one
from fly_serve.build import build_engine
from fly_serve.loading import load_tokenizer
from fly_serve.prompts import chat_prompt
from fly_serve.weights import DEFAULT_DRAFTER, DEFAULT_TARGET


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_TARGET)
    prompts = [chat_prompt(tok, q) for q in QUESTIONS[: args.prompts]]
    for dtype in args.dtypes:
        engine = build_engine(DEFAULT_TARGET, DEFAULT_DRAFTER, dtype=dtype, drafter_precision="int8", max_batch=1)
        diverged, first = 0, []
        for p in prompts:  # one at a time: batching noise is not what this measures
            ar = timed_one(engine, p, mode="ar", max_tokens=args.max_tokens).ids
            spd = timed_one(engine, p, mode="spd", k=10, max_tokens=args.max_tokens).ids
            if ar != spd:
                diverged += 1
                first.append(next(i for i, (a, b) in enumerate(zip(ar + [-1], spd + [-2])) if a != b))
        print(
            json.dumps(
                dict(
                    dtype=dtype,
                    prompts=len(prompts),
                    max_tokens=args.max_tokens,
                    diverged=diverged,
                    first_difference_at=first,
                )
            ),
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main()
