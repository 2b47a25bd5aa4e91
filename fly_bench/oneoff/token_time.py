"""Where every millisecond of a token goes, fly-serve's against llama-server's (issue 51): the same
chat prompts, greedy, on the same GGUF files and kernels, one request at a time.

  python -m fly_bench.oneoff.token_time --prompts code rewrite math multilingual --max-tokens 160 \
      --served --peer --out bench_out/token_time

- **One process**: the engine as `fly-serve generate` builds it (the llama.cpp runtime), each round's
  parts timed from outside by wrapping them on the instances (nothing in the engine changes): inside
  `llama_decode` (target and drafter apart), the logits read-out (the batch's arrays and llama.cpp's
  logits as a tensor), the scorer's work on the logits (argmax, masks, sampling, the top-1 for Token
  Recycling), the decision, the commit (detokenize, stop strings), and the rest of the round (rows,
  k auto, the trace, the engine loop). Per token after the first (the first is the TTFT: the
  prompt's prefill).
- **Served** (`--served`): `fly-serve serve` with the profile as a child process; the same requests
  streamed over HTTP: the client's time per token after the first, the TTFT, and the CPU seconds each
  process of the service spent during the request (psutil), by role: the ingress replica (the engine
  and the kernels), the proxy, the controller, the raylet, the GCS, Ray's agents and the rest. What
  the served time per token adds to the one process's is Ray's and HTTP's.
- **llama-server** (`--peer`): its own timings (`predicted_per_token_ms`: its decode and sampling a
  token; `prompt_ms`) beside the client's time per token and TTFT.
- **The kernels' threads**, in every place (fly_bench.schedstat, Linux): the threads that run the
  kernels (the engine's process, the ingress replica's, llama-server's: those busy most of the
  request), per token of the whole request: their time on the cores, and their time runnable but
  waiting for a core, which is what the other threads on the machine cost the forward.
Methods: `ar` (plain decoding) and `default` (the profile's own defaults: k auto, strict). Each cell
runs `--repeats` times, one after the other, and reports its median; every run's prompt has a
number of its own in front (`fresh`), so no cache holds it and every TTFT is a prefill; the places
run one after the other (the one process in a child process, so that its threads are gone before
Serve starts), so a drift of the machine between them reads as a difference: ratios between places
are rougher than within one.
"""

import argparse
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import requests

from fly_bench.oneoff.served_vs_engine import engine_config_for, serving
from fly_bench.pause import listener_root
from fly_bench.prompts import TASKS
from fly_bench.report import write_results
from fly_bench.schedstat import busy_threads, thread_times

METHODS = {"ar": {"mode": "ar"}, "default": {}}
_NONCE = itertools.count(1)


def fresh(text: str) -> str:
    """The prompt with a number of its own in front: no run finds its prompt in a cache (ours or
    llama-server's) that an earlier run left, so every TTFT prefills it (the chat template's
    system part before it may be cached on both sides alike)."""
    return f"(#{next(_NONCE)}) {text}"


PARTS = ("llama_decode", "read_out", "scorer", "drafter", "drafter_decode", "decide", "commit", "round_rest")


# ---- one process
class Timers:
    """Seconds spent in wrapped methods of given instances, by name (nested calls both count)."""

    def __init__(self):
        self.s = defaultdict(float)
        self._undo = []

    def wrap(self, obj, method: str, name: str) -> None:
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.s[name] += time.perf_counter() - t

        setattr(obj, method, timed)
        self._undo.append((obj, method))

    def reset(self) -> None:
        self.s.clear()

    def undo(self) -> None:
        for obj, method in self._undo:
            delattr(obj, method)  # the instance attribute goes; the class's method shows again
        self._undo.clear()


def instrument(engine) -> Timers:
    t = Timers()
    target = engine.scorer.runner
    t.wrap(target, "_decode_chunk", "llama_decode")
    t.wrap(target, "_decode", "target_decode_total")
    t.wrap(engine.scorer, "verify", "verify_total")
    drafter = engine.drafters.get("model")
    if drafter is not None:
        t.wrap(drafter.runner, "_decode_chunk", "drafter_decode")
        t.wrap(drafter, "propose", "drafter")
    t.wrap(engine, "_decide", "decide")
    t.wrap(engine, "_commit", "commit")
    t.wrap(engine, "step", "step_total")
    return t


def split(s: dict) -> dict:
    """The wrapped totals as disjoint parts (ms): read-out = the target's _decode less its decodes,
    scorer = verify less the target's _decode, round_rest = step less everything inside it."""
    parts = {
        "llama_decode": s["llama_decode"],
        "read_out": s["target_decode_total"] - s["llama_decode"],
        "scorer": s["verify_total"] - s["target_decode_total"],
        "drafter": s["drafter"] - s["drafter_decode"],
        "drafter_decode": s["drafter_decode"],
        "decide": s["decide"],
        "commit": s["commit"],
    }
    parts["round_rest"] = s["step_total"] - s["verify_total"] - s["drafter"] - s["decide"] - s["commit"]
    return parts


def engine_run(engine, timers: Timers, ids: list[int], knobs: dict, max_tokens: int) -> dict:
    """One greedy request, its rounds stepped here: TTFT (the first step) and per token after it."""
    req = engine.add(ids, dict(knobs, max_tokens=max_tokens, temperature=0))
    before = thread_times(os.getpid())
    t0 = time.perf_counter()
    engine.step()
    ttft = time.perf_counter() - t0
    first = len(req.generated)
    timers.reset()
    t1 = time.perf_counter()
    while not req.finished:
        engine.step()
    wall = time.perf_counter() - t1
    n = max(len(req.generated) - first, 1)
    parts = split(timers.s)
    return {
        "tokens": len(req.generated),
        "ttft_ms": 1000 * ttft,
        "ms_per_token": 1000 * wall / n,
        "parts_ms_per_token": {k: 1000 * v / n for k, v in parts.items()},
        **kernel_threads(before, thread_times(os.getpid()), time.perf_counter() - t0, len(req.generated)),
        "rounds": req.stats.rounds,
        "text": req.text,
    }


def in_process(config: str, prompts: list[str], max_tokens: int, repeats: int, paired: bool = False) -> dict:
    """The one process's cells; paired: llama-server's too, its runs taking turns with the
    engine's (a peer run, then each method's, `repeats` times), so the machine's drift falls on
    both alike (cells "llama-server/<prompt>")."""
    from fly_serve.build import build_engine
    from fly_serve.engine.prompts import chat_prompt

    c = engine_config_for(config, tiny=False)
    engine = build_engine(c.target, c.drafter, config=c)
    timers = instrument(engine)
    out = {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(peer_server()) if paired else None
        for prompt in prompts:
            runs = defaultdict(list)
            for knobs in METHODS.values():
                engine_run(engine, timers, chat_prompt(engine.tokenizer, fresh(TASKS[prompt])), knobs, 8)  # warm-up
            if server is not None:
                peer_run(server, prompt, 8)
            for _ in range(repeats):
                if server is not None:
                    runs["llama-server"].append(peer_run(server, prompt, max_tokens))
                for method, knobs in METHODS.items():
                    ids = chat_prompt(engine.tokenizer, fresh(TASKS[prompt]))
                    runs[method].append(engine_run(engine, timers, ids, knobs, max_tokens))
            for name, got in runs.items():
                out[f"{name}/{prompt}"] = median_run(got)
        if server is not None:
            out["command"] = server.command
    timers.undo()
    return out


def kernel_threads(before: dict, after: dict, wall_s: float, tokens: int) -> dict:
    """The kernels' threads (those busy most of the run) per token of the whole request, its
    prefill included: their time on the cores and their time runnable but waiting for one
    (fly_bench.schedstat; nothing where it is unreadable)."""
    busy = busy_threads(before, after, wall_s)
    if not busy.on_cpu_s:
        return {}
    return {
        "threads_on_cpu_ms_per_token": 1000 * busy.on_cpu_s / tokens,
        "threads_waited_ms_per_token": 1000 * busy.waited_s / tokens,
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median ms per token, with every run's figure beside it."""
    runs = sorted(runs, key=lambda r: r["ms_per_token"])
    mid = dict(runs[len(runs) // 2])
    mid["all_ms_per_token"] = [round(r["ms_per_token"], 2) for r in runs]
    return mid


def in_process_child(config: str, prompts: list[str], max_tokens: int, repeats: int, paired: bool) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--in-process-only", "--config", config]
    cmd += ["--prompts", *prompts, "--max-tokens", str(max_tokens), "--repeats", str(repeats)]
    cmd += ["--paired"] if paired else []
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- served
ROLES = (  # a key found in the process's command line (case ignored) -> its role
    ("flyingress", "ingress replica"),
    ("proxyactor", "proxy"),
    ("servecontroller", "controller"),
    ("raylet", "raylet"),
    ("gcs_server", "gcs"),
    ("dashboard", "agents"),
    ("runtimeenvagent", "agents"),
    ("log_monitor", "log monitor"),
    ("autoscaler", "autoscaler monitor"),
    ("fly_cli.main", "launcher"),
)


def role(proc: psutil.Process) -> str:
    try:
        line = (" ".join(proc.cmdline()) or proc.name()).lower()
    except psutil.Error:
        return "gone"
    return next((r for key, r in ROLES if key in line), "other")


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process under root, by role."""
    out = defaultdict(float)
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[role(p)] += t.user + t.system
        except psutil.Error:
            continue
    return dict(out)


def stream_chat(url: str, text: str, knobs: dict, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    body |= {"fly": knobs} if knobs else {}
    t0 = time.perf_counter()
    ttft, parts, last = None, [], {}
    with requests.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(piece)
            last = chunk
    wall = time.perf_counter() - t0
    n = last["usage"]["completion_tokens"]
    return {
        "tokens": n,
        "ttft_ms": 1000 * ttft,
        "ms_per_token": 1000 * (wall - ttft) / max(n - 1, 1),
        "text": "".join(parts),
    }


def served_run(url: str, root: int, text: str, knobs: dict, max_tokens: int) -> dict:
    replica = _ingress_replica(root)
    before, threads = cpu_by_role(root), thread_times(replica)
    t0 = time.perf_counter()
    run = stream_chat(url, text, knobs, max_tokens)
    wall = time.perf_counter() - t0
    after = cpu_by_role(root)
    run["cpu_ms_per_token"] = {k: 1000 * (after[k] - before.get(k, 0.0)) / run["tokens"] for k in after}
    return run | kernel_threads(threads, thread_times(replica), wall, run["tokens"])


def _ingress_replica(root: int) -> int:
    """The ingress replica's process among the service's (its kernels' threads); 0 if not found."""
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(root).children(recursive=True):
            if role(p) == "ingress replica":
                return p.pid
    return 0


def served(config: str, prompts: list[str], max_tokens: int, repeats: int, port: int, idle_s: float) -> dict:
    out = {}
    with serving(config, port, tiny=False) as url:
        root = listener_root(port)
        before = cpu_by_role(root)
        time.sleep(idle_s)  # an idle service's own wake-ups
        after = cpu_by_role(root)
        out["idle_cpu_ms_per_s"] = {k: 1000 * (after[k] - before.get(k, 0.0)) / idle_s for k in after}
        for prompt in prompts:
            for method, knobs in METHODS.items():
                stream_chat(url, fresh(TASKS[prompt]), knobs, 8)  # warm-up
                runs = [served_run(url, root, fresh(TASKS[prompt]), knobs, max_tokens) for _ in range(repeats)]
                out[f"{method}/{prompt}"] = median_run(runs)
    return out


# ---- llama-server
def peer_server():
    """llama-server on the target's GGUF (fly_bench.llama_server: the runtime's repack rule, 2
    threads), not started yet (a context manager)."""
    from fly_bench.llama_server import LlamaServer
    from fly_serve.loading.weights import DEFAULT_TARGET, gguf_file

    return LlamaServer(gguf_file(DEFAULT_TARGET))


@functools.cache
def target_tokenizer():
    """The target's tokenizer, loaded once (the peer's prompts are rendered with it)."""
    from fly_serve.loading.loading import load_tokenizer
    from fly_serve.loading.weights import DEFAULT_TARGET

    return load_tokenizer(DEFAULT_TARGET, print)


def peer_run(server, prompt: str, max_tokens: int) -> dict:
    """One streamed completion of the prompt (fresh), its prompt cache on as llama-server's API
    has it by default."""
    from fly_serve.engine.prompts import chat_prompt

    before = thread_times(server.proc.pid)
    c = server.complete(chat_prompt(target_tokenizer(), fresh(TASKS[prompt])), max_tokens, cache_prompt=True)
    n = len(c.token_ids)
    return kernel_threads(before, thread_times(server.proc.pid), c.wall_s, n) | {
        "tokens": n,
        "ttft_ms": 1000 * c.ttft_s,
        "ms_per_token": 1000 * (c.wall_s - c.ttft_s) / max(n - 1, 1),
        "server_ms_per_token": c.timings.get("predicted_per_token_ms"),
        "server_prompt_ms": c.timings.get("prompt_ms"),
        "text": c.text,
    }


def peer(prompts: list[str], max_tokens: int, repeats: int) -> dict:
    out = {}
    with peer_server() as server:
        out["command"] = server.command
        for prompt in prompts:
            peer_run(server, prompt, 8)  # warm-up
            out[f"llama-server/{prompt}"] = median_run([peer_run(server, prompt, max_tokens) for _ in range(repeats)])
    return out


# ---- the table
def table(result: dict) -> str:
    lines = [f"# Where a token's time goes ({result['cpu']}, {result['max_tokens']} tokens, greedy chat)", ""]
    for prompt in result["prompts"]:
        lines += [f"## {prompt}", "", "| ms per token | " + " | ".join(result["places"][prompt]) + " |"]
        lines.append("|---" * (1 + len(result["places"][prompt])) + "|")
        cols = list(result["places"][prompt].values())
        keys = ["ms_per_token", "ttft_ms"] + [f"part:{p}" for p in PARTS] + ["server_ms_per_token"]
        keys += ["threads_on_cpu_ms_per_token", "threads_waited_ms_per_token"]
        keys += sorted({f"cpu:{k}" for c in cols for k in c.get("cpu_ms_per_token", {})})
        for key in keys:
            vals = [_value(c, key) for c in cols]
            if all(v is None for v in vals):
                continue
            lines.append(f"| {key} | " + " | ".join("" if v is None else f"{v:.2f}" for v in vals) + " |")
        lines.append("")
    if "idle_cpu_ms_per_s" in result:
        lines += ["Idle service, CPU ms per second by role: " + json.dumps(result["idle_cpu_ms_per_s"]), ""]
    return "\n".join(lines)


def _value(cell: dict, key: str) -> float | None:
    if key.startswith("part:"):
        return cell.get("parts_ms_per_token", {}).get(key[5:])
    if key.startswith("cpu:"):
        return cell.get("cpu_ms_per_token", {}).get(key[4:])
    return cell.get(key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="deployments/profiles/cpu-default.yaml")
    p.add_argument("--prompts", nargs="+", default=["code", "rewrite", "math", "multilingual"], choices=sorted(TASKS))
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--served", action="store_true", help="also through `fly-serve serve`")
    p.add_argument("--peer", action="store_true", help="also llama-server on the target's GGUF")
    p.add_argument(
        "--paired",
        action="store_true",
        help="llama-server's runs take turns with the one process's, in its child (the ratio that drift spares)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds the idle service is watched")
    p.add_argument("--out", default="bench_out/token_time")
    p.add_argument("--in-process-only", action="store_true", help=argparse.SUPPRESS)  # the child's phase
    args = p.parse_args()
    if args.in_process_only:
        print(json.dumps(in_process(args.config, args.prompts, args.max_tokens, args.repeats, args.paired)))
        return
    from fly_bench.oneoff.served_vs_engine import cpu

    result = {"cpu": cpu()[0], "max_tokens": args.max_tokens, "prompts": args.prompts, "places": {}}
    cells = {"one process": in_process_child(args.config, args.prompts, args.max_tokens, args.repeats, args.paired)}
    if args.paired:  # the peer's runs that took turns with the one process's
        one = cells["one process"]
        result["paired_peer_command"] = one.pop("command")
        cells["paired llama-server"] = {k: one.pop(k) for k in [k for k in one if k.startswith("llama-server/")]}
    if args.served:
        cells["served"] = served(args.config, args.prompts, args.max_tokens, args.repeats, args.port, args.idle_s)
        result["idle_cpu_ms_per_s"] = cells["served"].pop("idle_cpu_ms_per_s")
    if args.peer:
        cells["llama-server"] = peer(args.prompts, args.max_tokens, args.repeats)
        result["peer_command"] = cells["llama-server"].pop("command")
    for prompt in args.prompts:
        result["places"][prompt] = {
            f"{where} {method}": cells[where][f"{method}/{prompt}"]
            for where in cells
            for method in (["llama-server"] if where.endswith("llama-server") else METHODS)
        }
    write_results(Path(args.out), result, table(result))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
