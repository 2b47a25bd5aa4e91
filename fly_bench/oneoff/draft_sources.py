"""What each draft source adds to tau and to speed, per prompt kind, side by side in one run.

    python -m fly_bench.oneoff.draft_sources --max-tokens 96 --k 15

The default pair in one process and one engine: target fp32 (bf16 is emulated on a CPU without
bf16 instructions), drafter int8. Per prompt kind (code, math, prose, and "repeat": rewrite code
given in the prompt), greedy: ar, pld, suffix (twice), recycle, spd, fly, fly with every MLA
level (mla_sources "pld,suffix,recycle") and fly without MLA. Speedups are against `ar` of the
same prompt in this run; nothing is asserted.

The suffix index and the token recycler learn from the engine's traffic (engine.py), so the
history each run sees is fixed here: every run of a kind starts from the sources as they were
after each earlier kind ran once (`suffix` 1st: the index has never seen this prompt), except
`suffix` 2nd, which follows `suffix` 1st directly and so has seen this very request once: what
a repeated request gets. The kinds run in the order listed.
"""

import argparse
import json

import torch

from fly_bench.prompts import TASKS
from fly_bench.timing import timed_one
from fly_serve.build import build_engine
from fly_serve.loading import load_model, load_tokenizer, set_threads
from fly_serve.prompts import chat_prompt
from fly_serve.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

REPEAT_CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns them sorted."""
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """Length covered by the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
REPEAT = (
    "Rename the function `merge_intervals` to `combine_ranges` and the variable `merged` to `result` in the "
    "code below. Return the whole code in one Python block, with no explanation.\n\n```python\n" + REPEAT_CODE + "```"
)
KINDS = {"code": TASKS["code"], "math": TASKS["math"], "prose": TASKS["prose"], "repeat": REPEAT}


def variants(k: int) -> list[tuple[str, dict]]:
    """(label, params) in the order they run; "suffix 2nd" must follow "suffix 1st"."""
    return [
        ("ar", dict(mode="ar")),
        ("pld", dict(mode="pld", k=k)),
        ("suffix 1st", dict(mode="suffix", k=k)),
        ("suffix 2nd", dict(mode="suffix", k=k)),
        ("recycle", dict(mode="recycle", k=k)),
        ("spd", dict(mode="spd", k=k)),
        ("fly", dict(mode="fly", k=k)),
        ("fly+sources", dict(mode="fly", k=k, mla_sources="pld,suffix,recycle")),
        ("fly no-mla", dict(mode="fly", k=k, mla=False)),
    ]


def snapshot(engine):
    return engine.suffix_index.snapshot(), engine.recycler.snapshot()


def restore(engine, state) -> None:
    """The shared sources back to `state` (in place: the drafters hold the same objects)."""
    engine.suffix_index.restore(state[0])
    engine.recycler.restore(state[1])


def run_kind(engine, kind: str, prompt: list[int], args) -> list[dict]:
    """Every variant on one prompt; leaves the sources as after this kind ran once."""
    base, after_one, runs, rows = snapshot(engine), None, [], []
    for label, params in variants(args.k):
        if label != "suffix 2nd":
            restore(engine, base)
        runs.append((label, timed_one(engine, prompt, **params, max_tokens=args.max_tokens, temperature=0.0)))
        if label == "suffix 1st":
            after_one = snapshot(engine)
    ar = runs[0][1]
    for label, t in runs:
        # every variant but fly is lossless in fp32
        extra = dict(kind=kind, variant=label, speedup=round(t.speedup_over(ar), 2), same_as_ar=t.ids == ar.ids)
        rows.append(t.row(**extra, ids=t.ids))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "ids"}), flush=True)
    restore(engine, after_one)
    return rows


def table(rows: list[dict], cell) -> str:
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    out = ["| kind | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for kind in kinds:
        by = {r["variant"]: r for r in rows if r["kind"] == kind}
        out.append(f"| {kind} | " + " | ".join(cell(by[label]) for label in labels) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=15, help="drafts per round of every drafting mode")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--drafter-head-cut", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write every run (with its token ids) here as JSON")
    args = ap.parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    tok = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, "fp32")
    drafter = load_model(DEFAULT_DRAFTER, "int8", head_cut=args.drafter_head_cut)
    engine = build_engine(target, drafter, tokenizer=tok, max_batch=1)
    warm = chat_prompt(tok, "Say hello.")
    timed_one(engine, warm, mode="ar", max_tokens=8)
    timed_one(engine, warm, mode="fly", k=4, max_tokens=8)
    engine.suffix_index.clear()  # the first kind starts from nothing learned
    engine.recycler.clear()
    rows = []
    for kind in args.kinds:
        rows += run_kind(engine, kind, chat_prompt(tok, KINDS[kind]), args)
    print(
        f"\nk={args.k}, max_tokens {args.max_tokens}, greedy, target fp32, drafter int8"
        f" (head cut {args.drafter_head_cut}), threads {torch.get_num_threads()}; kinds ran in this order"
    )
    print("\nspeedup vs ar of the same prompt (tau):\n")
    print(table(rows, lambda r: f"{r['speedup']}x ({r['tau']})"))
    print("\ntok/s:\n")
    print(table(rows, lambda r: str(r["tok_s"])))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
