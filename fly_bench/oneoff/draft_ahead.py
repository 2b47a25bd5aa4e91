"""Draft-ahead against the sequential round (issue 21's table): the same greedy requests, batch 1,
in one process with each split of torch threads, then (with --serve) through `fly-serve serve`
with the profile's draft_ahead off and on, one after the other so that they never share cores.

  python -m fly_bench.oneoff.draft_ahead --splits 2 1+1 2+2 1+3 --serve deployments/profiles/cpu-default.yaml \
      --max-tokens 160 --out bench_out/draft_ahead
  python -m fly_bench.oneoff.draft_ahead --target tiny:0 --drafter tiny:1 --max-tokens 24   # smoke run

A split "N" is the sequential engine on N torch threads (drafter and target in turn, each on all
N); "a+b" is draft-ahead with the drafter on a threads and the target on b, at once. Per (split,
method, prompt): tokens/s, round time, the drafter's and the target's milliseconds a round (for
draft-ahead the ahead call and the verify, which overlap; redraft: the lost bets' drafting, which
does not), the hit rate and the drafts thrown away. Every text is compared with the first
split's: draft-ahead must not change a token. Writes results.json and summary.md.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
import yaml

from fly_bench.oneoff.served_vs_engine import PROMPTS, chat, cpu, serving
from fly_bench.report import write_results

METHODS = {"fly_k15": {"mode": "fly", "k": 15, "theta": 0.3, "window": 6}, "spd_k8": {"mode": "spd", "k": 8}}


def parse_split(text: str) -> tuple[int, int, int] | None:
    """ "N" -> (N, 0, 0) sequential; "a+b" -> (0, a, b) draft-ahead."""
    if "+" in text:
        a, b = (int(x) for x in text.split("+"))
        return 0, a, b
    return int(text), 0, 0


def row(tokens: int, wall_s: float, fly: dict) -> dict:
    """One request's numbers from its stats (RequestStats.as_dict, the API's `fly` object)."""
    rounds = max(fly.get("rounds", 0), 1)
    hits, misses = fly.get("ahead_hits", 0), fly.get("ahead_misses", 0)
    verify = fly.get("verify_s", 0.0)
    # the ahead call ended draft_wait after the verdict, or verify_wait before it
    ahead = verify + fly.get("draft_wait_s", 0.0) - fly.get("verify_wait_s", 0.0) if hits + misses else 0.0
    ms = lambda s: round(1000 * s / rounds, 1)  # noqa: E731
    return {
        "tok_s": round(tokens / wall_s, 2),
        "tokens": tokens,
        "rounds": fly.get("rounds"),
        "round_ms": ms(wall_s),
        "draft_ms": ms(fly.get("draft_s", 0.0)),  # sequential: the drafting; draft-ahead: the redrafts
        "ahead_ms": ms(ahead),
        "verify_ms": ms(verify),
        "hit_rate": round(hits / (hits + misses), 3) if hits + misses else None,
        "dropped": fly.get("ahead_dropped", 0),
    }


# ---- in process
def in_process(args) -> dict:
    from fly_serve.build import build_engine
    from fly_serve.engine.prompts import chat_prompt

    engine = build_engine(args.target, args.drafter, calibrate=False)
    out, texts = {}, {}
    for split in args.splits:
        threads, a, b = parse_split(split)
        if threads:
            torch.set_num_threads(threads)
        engine.set_draft_ahead(not threads, a, b)
        res = out[split] = {}
        for method, knobs in METHODS.items():
            for name, text in PROMPTS.items():
                ids = chat_prompt(engine.tokenizer, text)
                engine.generate([ids], {**knobs, "max_tokens": 8})  # warm-up
                t = time.perf_counter()
                [req] = engine.generate([ids], {**knobs, "max_tokens": args.max_tokens})
                res[f"{method}/{name}"] = row(len(req.generated), time.perf_counter() - t, req.stats.as_dict())
                texts.setdefault(f"{method}/{name}", {})[split] = req.generated
    return {"runs": out, "same_tokens": same(texts)}


def same(texts: dict) -> dict:
    """Per (method, prompt): whether every split gave the first split's output."""
    return {key: len({tuple(t) if isinstance(t, list) else t for t in by.values()}) == 1 for key, by in texts.items()}


# ---- through Serve
def through_serve(config: str, args) -> dict:
    out, texts = {}, {}
    for ahead in (False, True):
        profile = yaml.safe_load(Path(config).read_text())
        profile["applications"][0]["args"]["draft_ahead"] = ahead
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=Path(config).parent, delete=False) as f:
            yaml.safe_dump(profile, f)
        where = f"serve, draft_ahead {'on' if ahead else 'off'}"
        res = out[where] = {}
        try:
            with serving(f.name, args.port, args.target.startswith("tiny")) as url:
                for method, knobs in {"default": {}, **METHODS}.items():
                    for name, text in PROMPTS.items():
                        chat(url, text, knobs, 8)  # warm-up
                        content, tokens, fly, wall = chat(url, text, knobs, args.max_tokens)
                        res[f"{method}/{name}"] = row(tokens, wall, fly)
                        texts.setdefault(f"{method}/{name}", {})[where] = content
        finally:
            Path(f.name).unlink()
    return {"runs": out, "same_tokens": same(texts)}


# ---- report
def summary(result: dict) -> str:
    lines = [f"CPU: {result['cpu']}; max_tokens {result['max_tokens']}; pair {result['pair']}", ""]
    for part in ("in_process", "serve"):
        if part not in result:
            continue
        runs = result[part]["runs"]
        lines += [
            f"### {part}",
            "",
            "| split | method/prompt | tok/s | round ms | draft (redraft) ms | ahead ms | verify ms "
            "| round / max(ahead or draft, verify) | hit rate | dropped |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for where, res in runs.items():
            for key, r in res.items():
                side = max(r["ahead_ms"] or r["draft_ms"], r["verify_ms"], 1e-9)
                lines.append(
                    f"| {where} | {key} | {r['tok_s']} | {r['round_ms']} | {r['draft_ms']} | {r['ahead_ms']} "
                    f"| {r['verify_ms']} | {r['round_ms'] / side:.2f} | {r['hit_rate']} | {r['dropped']} |"
                )
        same_all = all(result[part]["same_tokens"].values())
        lines += ["", f"equal outputs across {part} runs: {same_all} {result[part]['same_tokens']}", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--splits", nargs="+", default=["2", "1+1", "2+2"], help='"N" sequential, "a+b" draft-ahead')
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--serve", default=None, help="also through `fly-serve serve` with this profile, off then on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default="bench_out/draft_ahead")
    args = p.parse_args()
    result = {"cpu": cpu()[0], "max_tokens": args.max_tokens, "pair": [args.target, args.drafter]}
    result["in_process"] = in_process(args)
    if args.serve:
        result["serve"] = through_serve(args.serve, args)
    write_results(args.out, result, summary(result))


if __name__ == "__main__":
    main()
