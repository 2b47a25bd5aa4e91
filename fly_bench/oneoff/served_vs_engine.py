"""The service against the engine, one request at a time (issue 19's table): the same chat
requests, greedy, through `build_engine()` in one process and through `fly-serve serve` with each
profile given, one after the other so that they never share the cores.

  python -m fly_bench.oneoff.served_vs_engine --configs deployments/profiles/cpu-default.yaml \
      deployments/profiles/cpu-tp2.yaml \
      --max-tokens 160 --out bench_out/served

Methods: `ar`; `default` (no `fly` object: the profile's own defaults; in process the same
defaults); `fly_k15` (k 15, theta 0.3, window 6). Per (where, method, prompt): tokens/s, rounds,
drafts, and draft / verify milliseconds per round. Then the same greedy default request alone, 3
times plain and once streamed: how many different texts came back (one is the promise). Writes
results.json and summary.md; speed is compared only as ratios within the run.

`--cells ar/code default/code` measures only those (method/prompt) cells: shorter passes.

`--alternate N` runs the whole sequence N times (one process, then each profile; every other pass
in the reverse order), and the table gives each cell's median over the passes, with the ratios to
one process pass by pass: this VM's speed drifts by 20-30% within minutes, which a single pass
reads as a difference of places.

`--paired N` puts the two places a request apart instead of a pass apart: the first profile is
served, the engine is loaded in this process, and each cell runs N times in each, one request
after the other (every other pair in the reverse order); each pair gives a ratio over a minute
or less, where the drift moved little. Caveat: while the engine decodes, the idle service's Ray
processes are up too (their wake-ups: about 6% of a core here), as they are for every served
request. `--daemons N` measures that share alone: the engine in this process, N times with no
Ray running and N times beside an idle `--tiny` service (the same controller, proxy, raylet, GCS
and replica processes, with tiny models), taking turns.
"""

import argparse
import contextlib
import dataclasses
import json
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import yaml

from fly_bench.prompts import CODE
from fly_bench.report import write_results

# a rewrite copies most of its prompt: drafting pays most there
REWRITE = (
    "Rewrite this function with type hints and a docstring, changing nothing else:\n\n"
    "def moving_average(xs, n):\n    out = []\n    s = 0\n    for i, x in enumerate(xs):\n"
    "        s += x\n        if i >= n:\n            s -= xs[i - n]\n        if i >= n - 1:\n"
    "            out.append(s / n)\n    return out\n"
)
PROMPTS = {"code": CODE, "rewrite": REWRITE}
METHODS = {"ar": {"mode": "ar"}, "default": {}, "fly_k15": {"mode": "fly", "k": 15, "theta": 0.3, "window": 6}}
REPEATS = 3  # plain requests of the determinism check (plus one streamed)
CELLS = [f"{m}/{p}" for m in METHODS for p in PROMPTS]  # "method/prompt"


def profile_args(config: str) -> dict:
    return yaml.safe_load(Path(config).read_text())["applications"][0]["args"]


def row(tokens: int, wall_s: float, fly: dict) -> dict:
    rounds = max(fly.get("rounds", 0), 1)
    return {
        "tok_s": round(tokens / wall_s, 2),
        "tokens": tokens,
        "rounds": fly.get("rounds"),
        "drafted": fly.get("drafted"),
        "draft_ms_per_round": round(1000 * fly.get("draft_s", 0) / rounds, 1),
        "verify_ms_per_round": round(1000 * fly.get("verify_s", 0) / rounds, 1),
    }


# ---- in process
def engine_config_for(config: str, tiny: bool):
    """The EngineConfig the service builds from this profile (deployments/profiles/app_args.py names the
    engine's knobs as EngineConfig does): every engine knob the profile sets, its prefix cache and
    KV budgets too, not a chosen few."""
    from fly_serve.config import EngineConfig

    args = profile_args(config)
    knobs = {f.name: args[f.name] for f in dataclasses.fields(EngineConfig) if f.name in args}
    return EngineConfig(**{**knobs, **({"target": "tiny:0", "drafter": "tiny:1"} if tiny else {})})


def engine_for(config: str, tiny: bool):
    """build_engine() with the profile's engine config, as the service builds it."""
    from fly_serve.build import build_engine

    c = engine_config_for(config, tiny)
    return build_engine(c.target, c.drafter, config=c)


def engine_cell(engine, cell: str, max_tokens: int) -> dict:
    from fly_bench.timing import timed_one
    from fly_serve.engine.prompts import chat_prompt

    method, prompt = cell.split("/")
    t = timed_one(engine, chat_prompt(engine.tokenizer, PROMPTS[prompt]), **METHODS[method], max_tokens=max_tokens)
    counts = {"rounds": t.rounds, "drafted": t.drafted, "draft_s": t.draft_s, "verify_s": t.verify_s}
    return row(t.tokens, t.wall_s, counts)


def in_process(config: str, max_tokens: int, tiny: bool, cells: list[str]) -> dict:
    engine = engine_for(config, tiny)
    out = {}
    for cell in cells:
        engine_cell(engine, cell, 8)  # warm-up
        out[cell] = engine_cell(engine, cell, max_tokens)
    return out


# ---- through Serve
def chat(url: str, text: str, knobs: dict, max_tokens: int, stream: bool = False) -> tuple[str, int, dict, float]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    body |= {"fly": knobs} if knobs else {}
    t = time.perf_counter()
    if not stream:
        r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
        r.raise_for_status()
        o = r.json()
        return o["choices"][0]["message"]["content"], o["usage"]["completion_tokens"], o["fly"], time.perf_counter() - t
    parts, last = [], {}
    with requests.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                parts += [c["delta"].get("content", "") for c in chunk.get("choices", [])]
                last = chunk
    return "".join(parts), last["usage"]["completion_tokens"], last["fly"], time.perf_counter() - t


@contextlib.contextmanager
def serving(config: str, port: int, tiny: bool):
    """`fly-serve serve` with this profile on 127.0.0.1:port until the block ends (SIGTERM then)."""
    cmd = [sys.executable, "-m", "fly_cli.main", "serve", "--config", config, "--port", str(port)]
    cmd += ["--tiny"] if tiny else []
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in server.stdout:  # the launcher prints "ready at" once /healthz answers
            seen.append(line)
            if "ready at" in line:
                break
        else:
            raise RuntimeError("the service did not become ready:\n" + "".join(seen[-30:]))
        threading.Thread(target=server.stdout.read, daemon=True).start()  # keep its pipe drained
        yield f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=300)


def in_process_child(config: str, max_tokens: int, tiny: bool, cells: list[str]) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--in-process-only", config, "--max-tokens", str(max_tokens)]
    cmd += ["--cells", *cells]
    done = subprocess.run(cmd + ["--tiny"] * tiny, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def served_cell(url: str, cell: str, max_tokens: int) -> dict:
    method, prompt = cell.split("/")
    _, tokens, fly, wall = chat(url, PROMPTS[prompt], METHODS[method], max_tokens)
    return row(tokens, wall, fly)


def through_serve(
    config: str, max_tokens: int, port: int, tiny: bool, cells: list[str], same_text: bool = True
) -> dict:
    with serving(config, port, tiny) as url:
        out = {}
        for cell in cells:
            served_cell(url, cell, 8)  # warm-up
            out[cell] = served_cell(url, cell, max_tokens)
        out["stats"] = requests.get(f"{url}/v1/fly/stats", timeout=60).json()
        if not same_text:
            return out
        runs = [chat(url, CODE, {}, 96) for _ in range(REPEATS)] + [chat(url, CODE, {}, 96, stream=True)]
        texts = [r[0] for r in runs]
        out["same_text"] = {
            "requests": len(texts),
            "distinct_texts": len(set(texts)),
            "rounds": [r[2].get("rounds") for r in runs],  # a different plan shows here first
            "first_difference_at": min(
                (i for i in range(96 * 8) if len({t[i : i + 1] for t in texts}) > 1), default=None
            ),
        }
        return out


def median_runs(passes: list[dict]) -> dict:
    """Each place's cells with tok/s the median over the passes (of two: their mean), the other
    figures from the pass nearest it; the first pass's other entries kept."""
    runs = {}
    for where, first in passes[0].items():
        runs[where] = dict(first)
        for cell in (k for k in first if "/" in k):
            speeds = [p[where][cell]["tok_s"] for p in passes]
            mid = statistics.median(speeds)
            nearest = min((p[where][cell] for p in passes), key=lambda r: abs(r["tok_s"] - mid))
            runs[where][cell] = nearest | {"tok_s": round(mid, 2), "tok_s_passes": speeds}
    return runs


def pass_ratios(passes: list[dict]) -> list[str]:
    """Per pass, served / one process of every cell: the ratio the drift cannot fake."""
    lines = []
    for i, runs in enumerate(passes):
        base = runs.get("one process")
        if base is None:
            continue
        for where, res in runs.items():
            if where != "one process":
                cells = [f"{c} {res[c]['tok_s'] / base[c]['tok_s']:.2f}x" for c in base]
                lines.append(f"- pass {i + 1}, {where} / one process: " + ", ".join(cells))
    return lines


# ---- places a request apart
def taking_turns(first, second, n: int) -> list[dict]:
    """n pairs of (first(), second()), every other pair in the reverse order, each with its ratio."""
    pairs = []
    for i in range(n):
        if i % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        pairs.append({"a": a, "b": b, "b_over_a": round(b["tok_s"] / a["tok_s"], 3)})
    return pairs


def paired(config: str, max_tokens: int, port: int, tiny: bool, cells: list[str], n: int) -> dict:
    """Each cell n times in one process and n times served, one request after the other."""
    engine = engine_for(config, tiny)
    with serving(config, port, tiny) as url:
        out = {}
        for cell in cells:
            engine_cell(engine, cell, 8)  # warm-ups
            served_cell(url, cell, 8)
            out[cell] = taking_turns(
                lambda c=cell: engine_cell(engine, c, max_tokens), lambda c=cell: served_cell(url, c, max_tokens), n
            )
        return out


def beside_ray(config: str, max_tokens: int, port: int, tiny: bool, cells: list[str], n: int) -> dict:
    """Each cell in one process, n times with no Ray running and n times beside an idle --tiny
    service: what Ray's and Serve's idle processes take from a forward."""
    engine = engine_for(config, tiny)

    def beside(cell: str) -> dict:
        with serving(config, port, tiny=True):
            time.sleep(10)  # the replica's start-up work done: only the idle wake-ups left
            return engine_cell(engine, cell, max_tokens)

    out = {}
    for cell in cells:
        engine_cell(engine, cell, 8)  # warm-up
        out[cell] = taking_turns(lambda c=cell: engine_cell(engine, c, max_tokens), lambda c=cell: beside(c), n)
    return out


def pairs_summary(title: str, a: str, b: str, pairs_by_cell: dict) -> list[str]:
    lines = ["", title, "", f"| cell | pair | {a} tok/s | {b} tok/s | {b} / {a} |", "|---|---|---|---|---|"]
    for cell, pairs in pairs_by_cell.items():
        for i, p in enumerate(pairs):
            lines.append(f"| {cell} | {i + 1} | {p['a']['tok_s']} | {p['b']['tok_s']} | {p['b_over_a']:.3f} |")
        ratios = [p["b_over_a"] for p in pairs]
        lines.append(f"| {cell} | median | | | **{statistics.median(ratios):.3f}** |")
    return lines


# ---- report
def summary(result: dict) -> str:
    cells = result["cells"]
    lines = [f"CPU: {result['cpu']}; bf16 instructions: {result['bf16']}; max_tokens {result['max_tokens']}", ""]
    if result["runs"]:
        lines += [
            "| where | " + " | ".join(f"{c} tok/s" for c in cells) + " | draft / verify ms a round, each cell |",
            "|---|" + "---|" * (len(cells) + 1),
        ]
    for where, res in result["runs"].items():
        speeds = " | ".join(str(res[c]["tok_s"]) for c in cells)
        ms = ", ".join(f"{res[c]['draft_ms_per_round']} / {res[c]['verify_ms_per_round']}" for c in cells)
        lines.append(f"| {where} | {speeds} | {ms} |")
    lines.append("")
    lines += pass_ratios(result.get("passes", []))
    for where, res in result["runs"].items():
        if "same_text" in res:
            s = res["same_text"]
            lines.append(f"- {where}: the same greedy request {s['requests']} times: {s['distinct_texts']} text(s)")
    if "paired" in result:
        title = "Served against one process, a request apart:"
        lines += pairs_summary(title, "one process", "served", result["paired"])
    if "beside_ray" in result:
        lines += pairs_summary(
            "One process with no Ray running against beside an idle --tiny service:",
            "no Ray",
            "beside Ray",
            result["beside_ray"],
        )
    return "\n".join(lines) + "\n"


def cpu() -> tuple[str, bool]:
    flags, name = "", platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = line
            break
    return name, "avx512_bf16" in flags or "amx_bf16" in flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["deployments/profiles/cpu-default.yaml"])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default="bench_out/served")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tiny", action="store_true", help="tiny random models: a smoke run of this script")
    p.add_argument(
        "--alternate", type=int, default=1, choices=range(1, 11), metavar="N", help="passes over every place (medians)"
    )
    p.add_argument("--cells", nargs="+", default=CELLS, choices=CELLS, metavar="METHOD/PROMPT", help=" ".join(CELLS))
    p.add_argument("--paired", type=int, default=0, metavar="N", help="N pairs a cell, one process and served")
    p.add_argument("--daemons", type=int, default=0, metavar="N", help="N pairs a cell, no Ray and beside Ray")
    p.add_argument("--in-process-only", help=argparse.SUPPRESS)  # the child process's own phase
    args = p.parse_args()
    if args.in_process_only:
        print(json.dumps(in_process(args.in_process_only, args.max_tokens, args.tiny, args.cells)))
        return
    name, bf16 = cpu()
    result = {"cpu": name, "bf16": bf16, "max_tokens": args.max_tokens, "cells": args.cells, "runs": {}, "passes": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.paired or args.daemons:
        if args.paired:
            result["paired"] = paired(args.configs[0], args.max_tokens, args.port, args.tiny, args.cells, args.paired)
            (out / "results.json").write_text(json.dumps(result, indent=1))
        if args.daemons:
            result["beside_ray"] = beside_ray(
                args.configs[0], args.max_tokens, args.port, args.tiny, args.cells, args.daemons
            )
        write_results(out, result, summary(result))
        return
    places = ([] if args.skip_in_process else [None]) + args.configs  # None: one process
    for i in range(args.alternate):
        runs = {}
        result["passes"].append(runs)
        # every other pass in the reverse order: a drift that runs one way through a pass then
        # favours each place once
        for config in places if i % 2 == 0 else places[::-1]:
            if config is None:  # a child process: its threads and memory are gone before Serve starts
                runs["one process"] = in_process_child(args.configs[0], args.max_tokens, args.tiny, args.cells)
            else:
                serve = through_serve(config, args.max_tokens, args.port, args.tiny, args.cells, i == 0)
                runs[f"Serve, {Path(config).stem}"] = serve
            (out / "results.json").write_text(json.dumps(result, indent=1))
    result["runs"] = median_runs(result["passes"])
    write_results(out, result, summary(result))


if __name__ == "__main__":
    main()
