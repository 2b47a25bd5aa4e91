"""Drafter time per drafted token and agreement with the target, by drafter lm_head cut.

    python -m fly_bench.oneoff.drafter_cost --head-cuts none 16384 32768 65536 --max-tokens 96

The default pair, target fp32 (bf16 is emulated on a CPU without bf16 instructions), drafter int8
(quantized once into the converted cache, one file per cut). Per cut and prompt kind, `spd` at
k = 8 without MLA (every draft is the drafter's own, so the figures are the drafter's alone):
drafter ms per drafted token (RequestStats.draft_s / drafted) and agreement (accepted / drafted).
Then a micro-measure: one drafter token after 200 cached, through our Runner (what drafting
pays) and through transformers' forward. Nothing is asserted; one JSON line per measurement,
then a markdown table.
"""

import argparse
import json
import statistics
import time

import torch

from fly_bench.oneoff.forward_cost import forward_ms
from fly_bench.prompts import TASKS
from fly_bench.timing import timed_one
from fly_serve.build import build_engine
from fly_serve.engine.prompts import chat_prompt
from fly_serve.loading.head_cut import CutHead
from fly_serve.loading.loading import load_model, load_tokenizer, set_threads
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET
from fly_serve.runtime.runner import Runner

KINDS = ("code", "math", "prose")  # prompts.TASKS


def head_cut_arg(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def drafted_run(engine, prompt: list[int], k: int, max_tokens: int) -> dict:
    """One greedy `spd` request without MLA; the drafter's share of it."""
    t = timed_one(engine, prompt, mode="spd", k=k, mla=False, temperature=0.0, max_tokens=max_tokens)
    return dict(
        drafted=t.drafted,
        accepted=t.accepted,
        draft_s=t.draft_s,
        tau=round(t.tau, 2),
        ms_per_draft=round(1000 * t.draft_s / max(t.drafted, 1), 2),
        agreement=round(t.accepted / max(t.drafted, 1), 3),
        ids=t.ids,
    )


def runner_one_token_ms(model, context: list[int], reps: int) -> float:
    """Median ms of one drafter token after len(context) cached, through the engine's Runner: the
    last token is fed again each time (tail=[1]), so every forward is one new token."""
    runner = Runner(model, n_slots=1)
    seq = context + [context[-1]]
    runner.feed(["m"], [seq])
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        runner.feed(["m"], [seq], tail=[1])
        if i >= 3:  # the first few warm the allocator and kernels
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure_cut(target, tok, head_cut, prompts: dict, args) -> list[dict]:
    drafter = load_model(DEFAULT_DRAFTER, "int8", head_cut=head_cut)
    context = torch.randint(0, 1000, (1, args.context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        micro = dict(
            runner_ms=round(runner_one_token_ms(drafter, context[0].tolist(), args.reps), 2),
            hf_ms=round(forward_ms(drafter, context, 1, reps=3), 2),
        )
    engine = build_engine(target, drafter, tokenizer=tok, max_batch=1)
    drafted_run(engine, prompts["code"], 4, 8)  # warm-up
    head = drafter.lm_head
    kept = len(head.keep) if isinstance(head, CutHead) else head.out_features  # lm_head rows a token pays for
    rows = [dict(head_cut=head_cut, kind="micro", kept_rows=kept, context=args.context, **micro)]
    for kind, prompt in prompts.items():
        run = drafted_run(engine, prompt, args.k, args.max_tokens)
        rows.append(dict(head_cut=head_cut, kind=kind, k=args.k, **run))
    return rows


def summary(head_cut, rows: list[dict], reference: dict) -> dict:
    """One line per cut: drafted-token cost and agreement over all prompts together."""
    runs = [r for r in rows if r["kind"] != "micro"]
    micro = next(r for r in rows if r["kind"] == "micro")
    drafted = sum(r["drafted"] for r in runs)
    return dict(
        head_cut=head_cut,
        ms_per_draft=round(1000 * sum(r["draft_s"] for r in runs) / max(drafted, 1), 2),
        agreement=round(sum(r["accepted"] for r in runs) / max(drafted, 1), 3),
        **{f"agree_{r['kind']}": r["agreement"] for r in runs},
        kept_rows=micro["kept_rows"],
        runner_ms=micro["runner_ms"],
        hf_ms=micro["hf_ms"],
        # Greedy fp32 spd emits the target's tokens whatever the drafter: a check, not a figure.
        same_output=all(r["ids"] == reference[r["kind"]] for r in runs),
    )


def table(lines: list[dict]) -> str:
    cols = list(lines[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in lines]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-cuts", type=head_cut_arg, nargs="+", default=[None, 16384, 32768, 65536])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the micro-measure's token")
    ap.add_argument("--reps", type=int, default=30, help="timed one-token forwards of the micro-measure")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    tok = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, "fp32")
    prompts = {kind: chat_prompt(tok, TASKS[kind]) for kind in KINDS}
    lines, reference = [], None
    for head_cut in args.head_cuts:
        rows = measure_cut(target, tok, head_cut, prompts, args)
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "ids"}), flush=True)
        reference = reference or {r["kind"]: r["ids"] for r in rows if "ids" in r}
        lines.append(summary(head_cut, rows, reference))
        print(json.dumps(lines[-1]), flush=True)
    print(
        f"\nspd k={args.k}, mla off, max_tokens {args.max_tokens}, target fp32, drafter int8, "
        f"threads {torch.get_num_threads()}\n"
    )
    print(table(lines))


if __name__ == "__main__":
    main()
