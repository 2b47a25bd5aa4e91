"""A llama.cpp forward's cost by its width (tokens in one llama_decode), and the split plan the
runtime derives from it (fly_serve/runtime/forward_widths.py), measured afresh (no cache):

    python -m fly_bench.oneoff.forward_widths                     # the target as the runtime loads it
    python -m fly_bench.oneoff.forward_widths --no-repack --passes 3
    GGML_CPU_TILED_MM=0 python -m fly_bench.oneoff.forward_widths # llama.cpp's tiled matmul off

Then, with --ab N: N tokens in one call against the plan's calls, alternating (one row, and N rows
of one token), medians of --repeats.
"""

import argparse
import json
import random
import statistics
import time

from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, gguf_file
from fly_serve.runtime import forward_widths, llama_runner


def ab(r, n: int, repeats: int) -> dict:
    """ms of n tokens in one call and in the plan's calls: one row of n, and n rows of one."""
    rng = random.Random(1)
    vocab = r.vocab_size
    keys = [f"ab-{i}" for i in range(n)]
    rows = [[rng.randrange(vocab) for _ in range(150)] for _ in keys]
    r.feed(keys, rows, tail=[1] * n)
    plan, out = r.widths, {}
    for _ in range(repeats):
        for name, widths in (("one call", None), ("split", plan)):
            r.set_widths(widths)
            for shape in ("1 row", f"{n} rows"):
                if shape == "1 row":
                    extra = [rng.randrange(vocab) for _ in range(n)]
                    t0 = time.perf_counter()
                    r.feed(keys[:1], [rows[0] + extra], tail=[n])
                else:
                    for row in rows:
                        row.append(rng.randrange(vocab))
                    t0 = time.perf_counter()
                    r.feed(keys, rows, tail=[1] * n)
                out.setdefault(f"{shape}, {name}", []).append(1000 * (time.perf_counter() - t0))
    r.set_widths(plan)
    r.release(keys)
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["target", "drafter"], default="target")
    p.add_argument("--no-repack", action="store_true", help="weights as shipped (no repacking)")
    p.add_argument("--threads", type=int, default=0, help="0: the runtime's default")
    p.add_argument("--passes", type=int, default=forward_widths.PASSES)
    p.add_argument("--ab", type=int, default=8, help="the width of the A/B (0: none)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    path = gguf_file(DEFAULT_TARGET if args.model == "target" else DEFAULT_DRAFTER, print)
    model = llama_runner.GGUFModel(str(path), repack=False if args.no_repack else None)
    r = llama_runner.LlamaRunner(model, threads=args.threads)
    seconds = forward_widths.measure(r, passes=args.passes)
    plan = forward_widths.plan(seconds)
    r.set_widths(plan)
    print(json.dumps({"model": path.name, "repacked": model.repacked, "threads": r.threads}))
    print("ms by width:", {w: round(1000 * s, 1) for w, s in enumerate(seconds, 1)})
    print("split:", {n: w for n, w in enumerate(plan, 1) if len(w) > 1} or "none")
    if args.ab:
        print(f"{args.ab} tokens, ms (medians of {args.repeats}):", ab(r, args.ab, args.repeats))


if __name__ == "__main__":
    main()
