"""Device check on a CUDA machine, one JSON line out (what an operator runs before going live):

    bash scripts/gpu_check.sh            # = this script after the engine tests that run on any device

1. exactness: spd == ar in fp32 on the GPU (the default pair when its weights are installed,
   else the tiny pair: both Hub-free);
2. speed: fly vs ar at batch 1 and 8, bf16 target and drafter, greedy, ratios from one run.
"""

import argparse
import json
import time

import torch

from fly_serve.build import build_engine
from fly_serve.prompts import chat_prompt
from fly_serve.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, cache_dir

QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "Reverse a linked list in C.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts orders per customer.",
    "Write quicksort in Python.",
    "What is the derivative of x^3 * sin(x)?",
    "Translate 'good morning, how are you?' into German.",
    "Write a bash one-liner that counts lines in all .py files.",
]


def pair_names() -> tuple[str, str]:
    installed = (cache_dir() / f"{DEFAULT_TARGET}-hf").is_dir() and (cache_dir() / f"{DEFAULT_DRAFTER}-hf").is_dir()
    return (DEFAULT_TARGET, DEFAULT_DRAFTER) if installed else ("tiny:0", "tiny:1")


def throughput(engine, prompts, params) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    return sum(r.stats.emitted for r in reqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    target, drafter = pair_names()
    out = {"device": torch.cuda.get_device_name(0), "pair": [target, drafter]}

    exact = build_engine(target, drafter, dtype="fp32", drafter_precision="fp32", max_batch=4)
    prompts = [chat_prompt(exact.tokenizer, q) for q in QUESTIONS]
    ar = [r.generated for r in exact.generate(prompts[:4], dict(mode="ar", max_tokens=48))]
    spd = [r.generated for r in exact.generate(prompts[:4], dict(mode="spd", k=8, max_tokens=48))]
    out["fp32_spd_equals_ar"] = ar == spd
    del exact
    torch.cuda.empty_cache()

    engine = build_engine(target, drafter, dtype="bf16", drafter_precision="bf16", max_batch=8)
    for batch in (1, 8):
        engine.generate(prompts[:batch], dict(mode="fly", max_tokens=16))  # warm-up (kernels, caches)
        base = dict(max_tokens=args.max_tokens)
        rates = {mode: throughput(engine, prompts[:batch], dict(base, mode=mode)) for mode in ("ar", "spd", "fly")}
        out[f"batch{batch}"] = {f"{m}_tok_s": round(v, 1) for m, v in rates.items()} | {
            "fly_vs_ar": round(rates["fly"] / rates["ar"], 2),
            "spd_vs_ar": round(rates["spd"] / rates["ar"], 2),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
