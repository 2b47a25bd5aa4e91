"""The prefix cache (fly_serve/runtime/kv_cache.py), on against off, on one engine pair loaded once:

1. time to first token of a request whose prompt is a --prefix-tokens long document and a
   question, then of a second request with the same document and another question (goal: the
   second's first token at least 5x sooner than the first's, with the cache on);
2. an N-turn chat (--turns) over the same document, each turn's prompt the conversation so far:
   its prefill time, summed over turns, as the time to each turn's first token (goal: at least 3x
   less with the cache on);
3. the outputs, token for token, on against off (equal in fp32).

    python -m fly_bench.oneoff.prefix_cache --out bench_out/prefix_cache.json
    python -m fly_bench.oneoff.prefix_cache --target tiny:0 --drafter tiny:1 --prefix-tokens 300  # seconds

The prompts are token ids built from the shared prompts (fly_bench.prompts), one turn appended
to the last at the token level, so a turn's prompt is exactly the previous prompt plus its
answer plus the new question. Nothing is asserted; the goals are printed with what was measured.
"""

import argparse
import json
import time

import torch

from fly_bench.prompts import COMPLETIONS, QUESTIONS, TASKS
from fly_serve.build import build_engine
from fly_serve.engine.prompts import encode
from fly_serve.loading.loading import load_model, load_tokenizer
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

TURN_TOKENS = 64  # room for one turn's question, at most (the questions are shorter)


def document(tokenizer, n_tokens: int) -> list[int]:
    """A long shared prefix (a system prompt, a tool list, a document) of exactly n_tokens."""
    parts = [*TASKS.values(), *QUESTIONS, *COMPLETIONS]
    ids: list[int] = []
    i = 0
    while len(ids) < n_tokens:
        ids += encode(tokenizer, f"[{i}] {parts[i % len(parts)]}\n")
        i += 1
    return ids[:n_tokens]


def run_one(engine, ids: list[int], params: dict) -> dict:
    """One request alone: its time to first token, its whole time, its output ids."""
    t0 = time.perf_counter()
    req = engine.add(ids, params)
    while not req.generated and not req.finished:
        engine.step()
    ttft = time.perf_counter() - t0
    while not req.finished:
        engine.step()
    return dict(
        ttft_s=ttft,
        wall_s=time.perf_counter() - t0,
        ids=req.generated,
        prompt_tokens=len(ids),
        prefix_hit_tokens=req.stats.prefix_hit_tokens,
        draft_prefix_hit_tokens=req.stats.draft_prefix_hit_tokens,
    )


def second_request(engine, tokenizer, doc: list[int], params: dict) -> list[dict]:
    return [run_one(engine, doc + encode(tokenizer, f"\nQuestion: {q}\nAnswer:"), params) for q in QUESTIONS[:2]]


def chat(engine, tokenizer, doc: list[int], turns: int, params: dict) -> list[dict]:
    history, out = list(doc), []
    for t in range(turns):
        prompt = history + encode(tokenizer, f"\nUser: {QUESTIONS[t % len(QUESTIONS)]}\nAssistant:")
        out.append(run_one(engine, prompt, params))
        history = prompt + out[-1]["ids"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help='"none": no draft model (then --mode ar)')
    ap.add_argument("--dtype", default="auto", help="the target's precision (fp32 for the equality check)")
    ap.add_argument("--drafter-precision", default="int8")
    ap.add_argument("--mode", default="fly")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, args.dtype)
    drafter = None if args.drafter == "none" else load_model(args.drafter, args.drafter_precision)
    params = dict(mode=args.mode, k=args.k, max_tokens=args.max_tokens, temperature=0.0)
    chat_len = args.prefix_tokens + args.turns * (args.max_tokens + TURN_TOKENS)
    engines = [
        build_engine(
            target,
            drafter,
            tokenizer=tokenizer,
            max_batch=2,
            max_model_len=max(4096, chat_len),
            kv_budget_tokens=max(8192, 4 * chat_len),
            prefix_cache=on,
            calibrate=False,
        )
        for on in (False, True)
    ]
    # a model with a short context (the tiny ones: 1,024) gets a shorter document, said so
    room = engines[0].max_model_len - args.turns * (args.max_tokens + TURN_TOKENS)
    if room < args.prefix_tokens:
        print(f"--prefix-tokens {args.prefix_tokens} does not fit the context window: {room} instead")
        args.prefix_tokens = room
    doc = document(tokenizer, args.prefix_tokens)
    results = {}
    for on, engine in zip((False, True), engines):
        run_one(engine, encode(tokenizer, "Warm up."), dict(params, max_tokens=4))
        name = "on" if on else "off"
        results[name] = dict(second=second_request(engine, tokenizer, doc, params))
        results[name]["chat"] = chat(engine, tokenizer, doc, args.turns, params)
        first, second = results[name]["second"]
        prefill = sum(turn["ttft_s"] for turn in results[name]["chat"])
        print(
            json.dumps(
                dict(
                    prefix_cache=name,
                    first_ttft_s=round(first["ttft_s"], 3),
                    second_ttft_s=round(second["ttft_s"], 3),
                    second_hit_tokens=second["prefix_hit_tokens"],
                    chat_prefill_s=round(prefill, 3),
                    chat_hit_tokens=sum(t["prefix_hit_tokens"] for t in results[name]["chat"]),
                )
            ),
            flush=True,
        )
    off, on = results["off"], results["on"]
    summary = dict(
        second_ttft_speedup=off["second"][0]["ttft_s"] / on["second"][1]["ttft_s"],
        second_vs_first_with_cache=on["second"][0]["ttft_s"] / on["second"][1]["ttft_s"],
        chat_prefill_ratio=sum(t["ttft_s"] for t in off["chat"]) / sum(t["ttft_s"] for t in on["chat"]),
        outputs_equal=all(
            a["ids"] == b["ids"] for part in ("second", "chat") for a, b in zip(off[part], on[part], strict=True)
        ),
    )
    print(
        f"second request, first token: {summary['second_vs_first_with_cache']:.1f}x sooner than the first "
        f"(goal >= 5x); {args.turns}-turn chat prefill: {summary['chat_prefill_ratio']:.1f}x less than without "
        f"the cache (goal >= 3x); outputs equal: {summary['outputs_equal']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), summary=summary, runs=results), f)


if __name__ == "__main__":
    main()
