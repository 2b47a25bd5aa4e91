"""k auto against fixed k with B rows together in one process: is a gap at load Serve's or the plan's?

  python -m fly_bench.oneoff.batch_k --rows 8 --passes 2 --max-tokens 96 --out bench_out/batch_k

The load sweep's chats (fly_bench.prompts.SWEEP_CHATS), B rows submitted together to one
build_engine() with the cpu-default profile's knobs, greedy. Methods `ar`, k auto and fixed k 1-4,
every other pass in the reverse order. For each method and pass: tokens/s, rounds, and drafts per
row and round. For k auto, a count of its rounds by batch size and the ks it gave (a batch shrinks
as rows finish). The frozen profile's predicted seconds of a round of B rows at k 0-5 (acceptance
0.8, one draft per drafter forward) come first. Writes results.json and summary.md. Speed is
compared only as ratios within the run.
"""

import argparse
import collections
import statistics

from fly_bench.oneoff.served_vs_engine import engine_for
from fly_bench.prompts import SWEEP_CHATS
from fly_bench.report import write_results
from fly_bench.timing import timed
from fly_serve.engine.prompts import chat_prompt
from fly_serve.k_auto.allocator import RowInfo

METHODS = {"ar": {"mode": "ar"}, "k auto": {}, "k 1": {"k": 1}, "k 2": {"k": 2}, "k 3": {"k": 3}, "k 4": {"k": 4}}


def predicted_ms(engine, rows: int) -> dict[int, float]:
    """The frozen profile's seconds of a round of `rows` rows all at k, acceptance 0.8."""
    cost = engine.policy.cost
    infos = [RowInfo(str(i), 5, acceptance=0.8) for i in range(rows)]
    return {k: round(1000 * cost.round_s([k] * rows, infos), 1) for k in range(6)}


def traced(engine) -> list[tuple[int, tuple[int, ...]]]:
    """Every round the policy plans from now on, as (rows, the ks it gave), appended to the list.
    `ar` rows are planned too (at k 0, their k is "auto" with no drafter): main keeps k auto's."""
    trace, choose = [], engine.policy.choose

    def choose_traced(infos):
        ks = choose(infos)
        trace.append((len(ks), tuple(ks)))
        return ks

    engine.policy.choose = choose_traced
    return trace


def run(engine, prompts: list, knobs: dict, max_tokens: int) -> dict:
    reqs = timed(engine, prompts, {**knobs, "max_tokens": max_tokens})
    return {
        "tok_s": round(sum(r.tokens for r in reqs) / sum(r.wall_s for r in reqs), 2),
        "rounds": max(r.rounds for r in reqs),
        "drafts_per_row_round": round(sum(r.drafted for r in reqs) / max(sum(r.rounds for r in reqs), 1), 2),
    }


def summary(result: dict) -> str:
    lines = [
        f"{result['rows']} rows together, {result['max_tokens']} tokens, one process",
        "",
        "Profile, predicted ms a round at k 0-5: "
        + ", ".join(f"k {k}: {ms}" for k, ms in result["predicted_ms"].items()),
        "",
        "| method | tok/s, each pass | x ar (median) | rounds | drafts a row-round |",
        "|---|---|---|---|---|",
    ]
    ar = statistics.median(r["tok_s"] for r in result["runs"]["ar"])
    for method, runs in result["runs"].items():
        speeds = [r["tok_s"] for r in runs]
        rounds = ", ".join(str(r["rounds"]) for r in runs)
        drafts = ", ".join(str(r["drafts_per_row_round"]) for r in runs)
        median = statistics.median(speeds) / ar
        lines.append(f"| {method} | {', '.join(map(str, speeds))} | {median:.2f} | {rounds} | {drafts} |")
    lines += ["", "k auto's rounds (all passes), by rows in the batch: the ks given, and how often", ""]
    for rows, counts in sorted(result["k_auto_rounds"].items(), key=lambda x: -int(x[0])):
        lines.append(f"- {rows} rows: " + ", ".join(f"{ks} x{n}" for ks, n in counts))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--config", default="deployments/profiles/cpu-default.yaml")
    p.add_argument("--tiny", action="store_true", help="tiny random models: a smoke run of this script")
    p.add_argument("--out", default="bench_out/batch_k")
    args = p.parse_args()
    engine = engine_for(args.config, args.tiny)
    prompts = [chat_prompt(engine.tokenizer, SWEEP_CHATS[i % len(SWEEP_CHATS)]) for i in range(args.rows)]
    result = {"rows": args.rows, "max_tokens": args.max_tokens, "predicted_ms": predicted_ms(engine, args.rows)}
    trace = traced(engine)
    engine.generate(prompts, {"max_tokens": 8})  # warm-up
    runs, by_rows = {m: [] for m in METHODS}, collections.defaultdict(collections.Counter)
    for i in range(args.passes):
        for method in METHODS if i % 2 == 0 else list(METHODS)[::-1]:
            trace.clear()
            runs[method].append(run(engine, prompts, METHODS[method], args.max_tokens))
            for rows, ks in trace if method == "k auto" else ():
                by_rows[rows][" ".join(map(str, ks))] += 1
    result["runs"] = runs
    result["k_auto_rounds"] = {str(r): c.most_common(4) for r, c in by_rows.items()}
    write_results(args.out, result, summary(result))


if __name__ == "__main__":
    main()
