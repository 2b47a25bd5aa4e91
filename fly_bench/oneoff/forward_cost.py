"""Target forward time by tokens in the forward, bf16 against fp32, on this machine.

    python -m fly_bench.oneoff.forward_cost

One forward of T new tokens after 200 cached (transformers' forward with a DynamicCache), best
of 3, torch threads 2. Where bf16 has no hardware support (AVX2 without bf16 instructions) the
bf16 time grows almost linearly in T, so verifying K drafts costs about K one-token steps and
speculation cannot pay; fp32 stays nearly flat up to a few dozen tokens. Nothing is asserted.
"""

import argparse
import time

import torch
from transformers import DynamicCache

from fly_serve.loading.loading import load_model, set_threads
from fly_serve.loading.weights import DEFAULT_TARGET


def forward_ms(model, context: torch.Tensor, new_tokens: int, reps: int = 3) -> float:
    best = float("inf")
    x = torch.randint(0, 1000, (1, new_tokens))
    for _ in range(reps):
        cache = DynamicCache(config=model.config)
        model(context, past_key_values=cache, use_cache=True)
        t0 = time.perf_counter()
        model(x, past_key_values=cache, use_cache=True)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    set_threads(args.threads)
    context = torch.randint(0, 1000, (1, 200))
    for precision in args.precisions:
        model = load_model(args.model, precision)
        with torch.inference_mode():
            for t in args.tokens:
                print(f"{precision} {t} tokens: {forward_ms(model, context, t):.0f} ms", flush=True)
        del model


if __name__ == "__main__":
    main()
