"""Load across batch sizes: Locust (as a library, headless) drives a running fly-serve at 1, 2, 4,
8 and 16 concurrent users for each method, one run per (method, level), one after the other.

    fly-serve serve &                                   # the default profile on 127.0.0.1:8000
    python -m loadtest.load_sweep --out loadtest/results/sweep
    python -m loadtest.load_sweep --users 1 8 --methods ar fly:k=15 fly:k=auto --duration 30
    python -m loadtest.load_sweep --users 8 --together 2 --max-tokens 160

Each user sends one streaming chat completion at a time (code and prose prompts, greedy), so
the users are the requests in flight. With `--together N` a run is N bursts instead: the users
arrive together, each sends one request, and the next burst starts when all have finished; user
j of burst n gets prompt j + n x users, so every method sees the same prompts (a paired
comparison, where a closed loop's methods each get whichever prompts its timing hands them).
The methods' bursts at a level take turns (burst n of every method, in reverse order every other
n), so a drift of the host's speed over the level reaches every method alike; each burst's
makespan is kept (summary.json "bursts_s"), and the table's "x ar (bursts)" is the median over
bursts of the method's tok/s against ar's in the same burst.

Per run: tokens/s (completion tokens from the responses' usage over the run's wall time), p50 /
p99 latency, p50 / p99 time to first token, and the drafts per round each request got (with k
"auto" that is the k the engine chose). Writes one CSV of requests per run, summary.json,
summary.md and, with matplotlib, throughput.png. Speedups are ratios against `ar` at the same
level in the same sweep; nothing is asserted.

`--check N` afterwards runs N sampled greedy (prompt, method) pairs through the in-process
engine and reports how many texts are equal (bf16 numerics may differ with batch composition).

`--peer llama-server [llama-server-draft ...]` adds llama.cpp's own server as a peer: the sweep
starts one per peer (fly_bench/llama_server.py; build it with scripts/build_llama_server.sh) on the
GGUF files of --peer-target / --peer-drafter (default: the embedded pair, the files fly-serve's
llama.cpp runtime reads), with as many slots (-np) as the largest user count, and sends it the same
users, bursts and prompts through its OpenAI-compatible /v1/chat/completions (streamed, usage). Its
rows stand beside fly-serve's methods at every user count, and every row gets its ratio against
the first peer (tok/s, the same bursts, TTFT). `--methods` with no names runs the peers alone.
The peer runs beside the fly-serve service the sweep drives, which takes cores from it as from
ours (2.4-5.2% of its speed on a 2-core VM, docs/journal.md "The idle service's tax on the cores").
A user who runs one server at a time gives it the machine alone: with `--peer-alone` the sweep
stops the service (SIGSTOP to every process of the server listening on --host's port: for
`fly-serve serve`, the launcher, Ray's processes and workers; fly_bench/pause.py) for each of a
peer's bursts, runs and warm-up, and continues it after.

    python -m loadtest.load_sweep --users 1 2 4 8 16 --methods ar fly:k=auto --peer llama-server \
        llama-server-draft --together 3 --max-tokens 160 --peer-alone

`--fresh` puts a number of its own before each request's prompt, so no server's prompt cache holds
it and every time to first token prefills the prompt (without it the methods of one server share
its cache: a prompt another method sent before is prefilled once, and its TTFT reads low).

`--prompts code rewrite math ...` sends the named one-prompt tasks (fly_bench.prompts.TASKS)
instead of the sweep's chats; with `--together N` at 1 user, burst n sends prompt n, and
summary.md adds a table by prompt (each method's tok/s, and its ratios against ar and the peer on
that prompt).
"""

import argparse
import contextlib
import csv
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import gevent
import huggingface_hub.hf_api  # noqa: F401  (before locust: see below)
from locust import HttpUser, constant, task
from locust.env import Environment
from locust.exception import StopUser

from fly_bench.llama_server import LlamaServer, LlamaServerMissing
from fly_bench.methods import parse_method
from fly_bench.pause import listener_tree, paused
from fly_bench.prompts import SWEEP_CHATS, TASKS

# `import locust` patches the process for gevent, which takes select.epoll away; huggingface_hub
# (2.4 on, through httpx2) imports trio, which needs it at import. So the hub is imported first
# (above, in isort's order: h before l), and transformers (fly_serve.loading.weights, the --check engine)
# finds it loaded.

PROMPTS: list[str] = list(SWEEP_CHATS)  # what the users send (--prompts replaces them)
NONCES: list[itertools.count] = []  # --fresh: the counter of the numbers put before each request's prompt
SPAWN_AT_ONCE = 10_000  # users a second: a burst's users start within milliseconds of each other
BURST_DEADLINE_S = 900  # a burst's requests unfinished by then count as failures


@dataclass
class Method:
    name: str  # "ar", "fly:k=15", "fly:k=auto", "spd:k=6" ...; a peer's: "llama-server" ...
    fly: dict | None  # the request's `fly` object; None: a peer, which gets none
    host: str | None = None  # a peer's own server; None: the sweep's --host

    @classmethod
    def parse(cls, text: str) -> "Method":
        mode, _, rest = text.partition(":")
        fly = {"mode": mode}
        for part in filter(None, rest.split(",")):
            key, _, value = part.partition("=")
            fly[key] = int(value) if value.lstrip("-").isdigit() else float(value) if "." in value else value
        return cls(text, fly)


@dataclass
class PeerAlone:
    """--peer-alone: the fly-serve service (the server on --host's port, this machine) stopped
    while a peer runs; port None: the peers run beside it."""

    port: int | None
    pauses: int = 0

    @contextlib.contextmanager
    def __call__(self, method: Method):
        if method.fly is not None or self.port is None:
            yield
            return
        with paused(listener_tree(self.port)):
            yield
        self.pauses += 1
        time.sleep(0.5)  # the service's own catch-up after its pause, not in the next method's run


BESIDE = PeerAlone(None)


@dataclass
class Record:
    method: str
    users: int
    prompt: int
    start: float
    ttft_s: float
    latency_s: float
    tokens: int
    rounds: int
    drafted: int
    text: str
    burst: int | None = None  # with --together: which burst it came in
    prefix: str = ""  # --fresh: what went before the prompt (its number)


def user_class(method: Method, users: int, max_tokens: int, records: list[Record], burst: int | None = None) -> type:
    """Closed-loop users (burst None): each sends one request after another. In a burst, user j
    of the burst sends one request, prompt (j + burst x users), and stops: every method of a
    sweep then gets the same prompts at the same users."""
    seats = itertools.count()

    class SweepUser(HttpUser):
        wait_time = constant(0)

        def on_start(self):
            self.sent = 0
            self.seat = next(seats)

        @task
        def complete(self):
            if burst is None:
                i = (self.sent * users + id(self) % 997) % len(PROMPTS)
            else:
                i = (self.seat + burst * users) % len(PROMPTS)
            self.sent += 1
            try:
                self.send(i)
            finally:
                if burst is not None:
                    raise StopUser()

        def send(self, i: int) -> None:
            prefix = f"(#{next(NONCES[0])}) " if NONCES else ""
            body = {
                "messages": [{"role": "user", "content": prefix + PROMPTS[i]}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if method.fly is not None:
                body["fly"] = method.fly
            t0 = time.perf_counter()
            ttft, text, last = None, [], None
            name = f"chat [{method.name}]"
            with self.client.post(
                "/v1/chat/completions", json=body, stream=True, name=name, catch_response=True, timeout=600
            ) as r:
                if r.status_code != 200:
                    r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                    return
                try:
                    for line in r.iter_lines(decode_unicode=True):
                        if not line or not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: ") :])
                        for c in chunk.get("choices", []):
                            piece = c.get("delta", {}).get("content") or ""
                            if piece and ttft is None:
                                ttft = time.perf_counter() - t0
                            text.append(piece)
                        if chunk.get("usage"):
                            last = chunk
                except Exception as e:  # a stream cut or garbled mid-way: a failure of this request
                    r.failure(f"stream broken: {type(e).__name__}: {e}")
                    return
                if last is None:
                    r.failure("no usage chunk")
                    return
            fly = last.get("fly") or {}
            drafted = fly.get("drafted", (last.get("timings") or {}).get("draft_n", 0))  # llama-server's own count
            records.append(
                Record(
                    method.name,
                    users,
                    i,
                    t0,
                    ttft if ttft is not None else float("nan"),
                    time.perf_counter() - t0,
                    last["usage"]["completion_tokens"],
                    fly.get("rounds", 0),
                    drafted,
                    "".join(text),
                    burst,
                    prefix,
                )
            )

    return SweepUser


def run_level(
    host: str, method: Method, users: int, duration_s: float, max_tokens: int, alone: PeerAlone = BESIDE
) -> tuple[list[Record], dict]:
    """`users` users for `duration_s`, then the users stop after their request in flight."""
    records: list[Record] = []
    classes = [user_class(method, users, max_tokens, records)]
    env = Environment(user_classes=classes, host=method.host or host, stop_timeout=900)
    runner = env.create_local_runner()
    with alone(method):
        t0 = time.perf_counter()
        runner.start(users, spawn_rate=users)
        gevent.sleep(duration_s)
        runner.stop()  # waits (up to stop_timeout) for the requests in flight
        wall = time.perf_counter() - t0
    failures = env.stats.total.num_failures
    runner.quit()
    return records, summarize(records, wall, failures)


def run_bursts(
    host: str, methods: list[Method], users: int, bursts: int, max_tokens: int, alone: PeerAlone = BESIDE
) -> dict[str, tuple]:
    """`bursts` times, `users` requests that arrive together (one per user, spawned at once) and
    all finish before the next burst, for every method in turn (reversed every other burst).
    Returns, per method, (records, summary): its wall is the sum of its bursts' makespans."""
    records: dict[str, list[Record]] = {m.name: [] for m in methods}
    makespans: dict[str, list[float]] = {m.name: [] for m in methods}
    failures = dict.fromkeys(records, 0)
    for burst in range(bursts):
        for method in methods if burst % 2 == 0 else methods[::-1]:
            with alone(method):
                wall, failed = one_burst(host, method, users, burst, max_tokens, records[method.name])
            makespans[method.name].append(wall)
            failures[method.name] += failed
    out = {}
    for m in methods:
        mine = records[m.name]
        s = summarize(mine, sum(makespans[m.name]), failures[m.name])
        s["bursts_s"] = [round(w, 2) for w in makespans[m.name]]
        s["burst_tokens"] = [sum(r.tokens for r in mine if r.burst == n) for n in range(bursts)]
        out[m.name] = (mine, s)
    return out


def one_burst(host: str, method: Method, users: int, burst: int, max_tokens: int, records: list[Record]):
    """One burst of `method`: (its makespan in seconds, its failed or unfinished requests)."""
    env = Environment(user_classes=[user_class(method, users, max_tokens, records, burst)], host=method.host or host)
    runner = env.create_local_runner()
    t0 = time.perf_counter()
    runner.start(users, spawn_rate=SPAWN_AT_ONCE)
    runner.spawning_greenlet.join()
    runner.user_greenlets.join(timeout=BURST_DEADLINE_S)  # each user stops after its one request
    wall = time.perf_counter() - t0
    failed = env.stats.total.num_failures + runner.user_count  # users still waiting: failed
    if runner.user_count:
        print(f"burst {burst}: {runner.user_count} requests unfinished after {BURST_DEADLINE_S} s", file=sys.stderr)
    runner.quit()
    return wall, failed


WARM_UP = "Say hello."  # in no prompt list: it primes no prefix cache for the measured prompts


def warm_up(host: str, method: Method) -> None:
    """One short request per method before any is timed: a server's first answer pays for its
    first touch of the weights (a llama-server's first request here took 5x its later ones)."""
    import requests  # after Locust's patching: urllib3 imported before it recurses in ssl

    body = {"messages": [{"role": "user", "content": WARM_UP}], "max_tokens": 8, "temperature": 0}
    if method.fly is not None:
        body["fly"] = method.fly
    try:
        r = requests.post(f"{host}/v1/chat/completions", json=body, timeout=600)
    except requests.RequestException as e:
        sys.exit(f"warm-up of {method.name} at {host}: {type(e).__name__}: {e}")
    if r.status_code != 200:
        sys.exit(f"warm-up of {method.name} at {host}: HTTP {r.status_code}: {r.text[:300]}")


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(records: list[Record], wall_s: float, failures: int) -> dict:
    tokens = sum(r.tokens for r in records)
    rounds = sum(r.rounds for r in records)
    return {
        "requests": len(records),
        "failures": failures,
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        # to the ms: a TTFT ratio against a peer reads them (tenths of a second at one user)
        "p50_latency_s": round(pct([r.latency_s for r in records], 0.5), 3),
        "p99_latency_s": round(pct([r.latency_s for r in records], 0.99), 3),
        "p50_ttft_s": round(pct([r.ttft_s for r in records], 0.5), 3),
        "p99_ttft_s": round(pct([r.ttft_s for r in records], 0.99), 3),
        "tau": round(tokens / rounds, 3) if rounds else 0.0,
        # drafts per round of each request: with k "auto", the k the engine chose on average
        "drafts_per_round": [round(r.drafted / r.rounds, 2) for r in records if r.rounds],
    }


def table(summary: dict, peer: str | None = None) -> str:
    """One line per (users, method): its figures, its ratios against ar and, with a peer, against
    the peer (tok/s, the same bursts, p50 TTFT)."""
    head = "| users | method | tok/s | x ar | x ar (bursts) |"
    if peer:
        head += f" x {peer} | x {peer} (bursts) | TTFT x {peer} |"
    head += " p50 s | p99 s | TTFT p50 s | tau | drafts/round (median) | requests |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for users, by_method in summary.items():
        ar, base = by_method.get("ar", {}), by_method.get(peer, {}) if peer else {}
        for name, s in by_method.items():
            drafts = statistics.median(s["drafts_per_round"]) if s["drafts_per_round"] else 0
            cells = [users, name, f"{s['tokens_per_s']:.2f}", rate_ratio(s, ar), burst_ratio(s, ar)]
            if peer:
                cells += [rate_ratio(s, base), burst_ratio(s, base), ttft_ratio(s, base)]
            cells += [s["p50_latency_s"], s["p99_latency_s"], s["p50_ttft_s"], s["tau"], f"{drafts:.1f}", s["requests"]]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def by_prompt(records: list[Record], names: list[str]) -> dict:
    """{users: {prompt name: {method: tok/s}}}: each method's tokens over the summed latencies of
    its requests of that prompt (at 1 user, its tokens over its time on that prompt)."""
    out: dict = {}
    for r in records:
        cell = out.setdefault(str(r.users), {}).setdefault(names[r.prompt], {}).setdefault(r.method, [0, 0.0])
        cell[0] += r.tokens
        cell[1] += r.latency_s
    return {
        u: {p: {m: round(t / s, 3) if s > 0 else 0.0 for m, (t, s) in ms.items()} for p, ms in ps.items()}
        for u, ps in out.items()
    }


def decode_by_prompt(records: list[Record], names: list[str]) -> dict:
    """{users: {prompt name: {method: ms a token after the first}}}: the median over its requests of
    (latency - TTFT) / (tokens - 1). The tok/s of by_prompt include each request's prefill, and a
    prompt's first request of a sweep prefills it cold while the later ones may find it cached (on
    fly-serve, whichever method met it first): the decoding apart from it compares like with like."""
    out: dict = {}
    for r in records:
        if r.tokens > 1 and math.isfinite(r.ttft_s):  # NaN: no text came back
            per = 1000 * (r.latency_s - r.ttft_s) / (r.tokens - 1)
            out.setdefault(str(r.users), {}).setdefault(names[r.prompt], {}).setdefault(r.method, []).append(per)
    return {
        u: {p: {m: round(statistics.median(v), 2) for m, v in ms.items()} for p, ms in ps.items()}
        for u, ps in out.items()
    }


def prompt_table(table_by_prompt: dict, peer: str | None = None, decode: dict | None = None) -> str:
    """One line per (users, prompt, method): tok/s on that prompt, x ar and x the peer on it; with
    decode (decode_by_prompt), its ms a token after the first and x the peer's by that."""
    head = "| users | prompt | method | tok/s | x ar |" + (f" x {peer} |" if peer else "")
    if decode is not None:
        head += " ms/token after the first |" + (f" x {peer} (after the first) |" if peer else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for users, prompts in table_by_prompt.items():
        for prompt, rates in prompts.items():
            after = (decode or {}).get(users, {}).get(prompt, {})
            for method, tps in rates.items():
                cells = [users, prompt, method, f"{tps:.2f}", _over(tps, rates.get("ar"))]
                if peer:
                    cells.append(_over(tps, rates.get(peer)))
                if decode is not None:
                    ms = after.get(method)
                    cells.append(f"{ms:.1f}" if ms else "-")
                    if peer:
                        cells.append(_over(after[peer], ms) if after.get(peer) else "-")  # the peer's time over ours
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _over(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def rate_ratio(s: dict, base: dict) -> str:
    """s's tok/s over base's ("-" without base)."""
    return f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}" if base.get("tokens_per_s") else "-"


def ttft_ratio(s: dict, base: dict) -> str:
    """s's p50 time to first token over base's ("-" without a figure on either side)."""
    mine, theirs = s.get("p50_ttft_s"), base.get("p50_ttft_s")
    if mine is None or not theirs or mine != mine or theirs != theirs:
        return "-"
    return f"{mine / theirs:.2f}"


def burst_ratio(s: dict, base: dict) -> str:
    """The median over bursts of s's tok/s against base's in the same burst ("-" without bursts)."""
    if not s.get("bursts_s") or not base.get("bursts_s"):
        return "-"
    rates = [
        (t / w) / (bt / bw)
        for t, w, bt, bw in zip(s["burst_tokens"], s["bursts_s"], base["burst_tokens"], base["bursts_s"])
        if w > 0 and bw > 0 and bt > 0
    ]
    return f"{statistics.median(rates):.2f}" if rates else "-"


def plot(summary: dict, path: Path, peer: str | None = None) -> bool:
    """Throughput per user count, and the ratio against each reference the sweep has (ar, the peer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    levels = [int(u) for u in summary]
    methods = list(next(iter(summary.values())))
    refs = [r for r in ("ar", peer) if r and all(summary[str(u)].get(r, {}).get("tokens_per_s") for u in levels)]
    fig, axes = plt.subplots(1, 1 + len(refs), figsize=(5.5 * (1 + len(refs)), 4), squeeze=False)
    a, ratio_axes = axes[0][0], axes[0][1:]
    for m in methods:
        tps = [summary[str(u)][m]["tokens_per_s"] for u in levels]
        a.plot(levels, tps, marker="o", label=m)
        for ax, ref in zip(ratio_axes, refs):
            base = [summary[str(u)][ref]["tokens_per_s"] for u in levels]
            ax.plot(levels, [t / b for t, b in zip(tps, base)], marker="o", label=m)
    a.set(xscale="log", xlabel="concurrent users", ylabel="tokens/s", title="throughput")
    for ax, ref in zip(ratio_axes, refs):
        ax.set(xscale="log", xlabel="concurrent users", ylabel=f"x {ref}", title=f"speedup over {ref}")
        ax.axhline(1.0, color="gray", lw=0.8)
    for ax in [a, *ratio_axes]:
        ax.set_xticks(levels, [str(u) for u in levels])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def check(records: list[Record], n: int, max_tokens: int) -> dict:
    """Greedy texts of n sampled requests against the in-process engine, one request at a time."""
    from fly_serve.build import build_engine
    from fly_serve.engine.prompts import chat_prompt

    engine = build_engine()
    sample = records[:: max(1, len(records) // n)][:n]
    equal = 0
    for r in sample:
        method = Method.parse(r.method)
        prompt = chat_prompt(engine.tokenizer, r.prefix + PROMPTS[r.prompt])
        [req] = engine.generate([prompt], {**method.fly, "max_tokens": max_tokens})
        equal += req.text == r.text
    return {"checked": len(sample), "equal_to_in_process": equal}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="http://127.0.0.1:8000")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument(
        "--methods",
        nargs="*",
        default=["ar", "fly:k=15", "fly:k=3", "fly:k=auto"],
        help="fly-serve's; none: peers only",
    )
    ap.add_argument("--duration", type=float, default=45.0, help="seconds users keep sending, per run")
    ap.add_argument(
        "--together",
        type=int,
        default=0,
        metavar="N",
        help="instead of --duration: N bursts per run, each user sending one request, all arriving together",
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        choices=sorted(TASKS),
        help="send these one-prompt tasks (fly_bench.prompts.TASKS) instead of the sweep's chats",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="a number of its own before each request's prompt: no server's prompt cache holds any (TTFT prefills)",
    )
    ap.add_argument("--check", type=int, default=0, help="greedy outputs to compare with the in-process engine")
    ap.add_argument("--out", default="loadtest/results/sweep")
    ap.add_argument(
        "--peer",
        nargs="+",
        default=[],
        metavar="NAME",
        help="llama.cpp's llama-server beside fly-serve: llama-server, llama-server-draft, llama-server-ngram "
        "(flags as NAME:flag=value, e.g. llama-server-draft:spec-draft-n-max=8); ratios against the first",
    )
    ap.add_argument("--peer-target", default=None, help="the peers' target (a model name or .gguf; default: embedded)")
    ap.add_argument("--peer-drafter", default=None, help="llama-server-draft's drafter (default: the embedded one)")
    ap.add_argument("--peer-threads", type=int, default=None, help="the peers' threads (default: this process's cores)")
    ap.add_argument("--peer-context", type=int, default=4096, help="tokens per peer slot")
    ap.add_argument(
        "--peer-alone",
        action="store_true",
        help="stop the fly-serve service (every process of the server on --host's port) while a peer runs: "
        "the machine to the peer alone, as a user who runs one server at a time gives it",
    )
    args = ap.parse_args(argv)
    if args.together < 0:
        ap.error(f"--together: a number of bursts, 0 or more (got {args.together})")
    if urlparse(args.host).hostname not in ("127.0.0.1", "localhost"):
        sys.exit(f"--host: only 127.0.0.1 is allowed (got {args.host})")
    if not args.methods and not args.peer:
        ap.error("--methods: none given and no --peer: nothing to measure")
    if args.peer_alone:
        if not args.peer:
            ap.error("--peer-alone: no --peer to give the machine to")
        try:
            listener_tree(urlparse(args.host).port or 80)
        except LookupError as e:
            ap.error(f"--peer-alone: the service at {args.host}: {e}")
    if args.prompts:
        PROMPTS[:] = [TASKS[name] for name in args.prompts]
    if args.fresh:  # from the clock: a sweep after another against the same servers gets other numbers
        NONCES[:] = [itertools.count(time.time_ns() // 1000 % 10**9)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        peers = {name: stack.enter_context(server) for name, server in peer_servers(args, ap)}  # started
        methods = [Method.parse(m) for m in args.methods] + [Method(n, None, s.url) for n, s in peers.items()]
        sweep(args, methods, out, peers)


def sweep(args, methods: list[Method], out: Path, peers: dict[str, LlamaServer]) -> None:
    """Every user count, every method and peer; the files and the table. Ratios against the first peer."""
    summary: dict = {}
    every: list[Record] = []
    alone = PeerAlone(urlparse(args.host).port or 80) if args.peer_alone else BESIDE
    for method in methods:
        with alone(method):
            warm_up(method.host or args.host, method)
    for users in args.users:
        if args.together:
            runs = run_bursts(args.host, methods, users, args.together, args.max_tokens, alone)
        else:
            runs = {m.name: run_level(args.host, m, users, args.duration, args.max_tokens, alone) for m in methods}
        for method in methods:
            records, s = runs[method.name]
            summary.setdefault(str(users), {})[method.name] = s
            every += records
            name = method.name.replace(":", "_").replace("=", "").replace(",", "_")
            with open(out / f"{name}-u{users}.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(Record.__dataclass_fields__))
                w.writeheader()
                w.writerows(asdict(r) for r in records)
            print(json.dumps({"users": users, "method": method.name, **s}), flush=True)
    levels = dict(summary)
    if args.check:  # the peers answer from their own servers: only fly-serve's records are checked
        summary["check"] = check([r for r in every if r.method not in peers], args.check, args.max_tokens)
    if peers:
        summary["peers"] = {name: server.command for name, server in peers.items()}
        summary["peers_alone"] = {"service_paused_times": alone.pauses} if args.peer_alone else False
    peer = next(iter(peers), None)
    report = table(levels, peer)
    if args.prompts:
        summary["by_prompt"] = by_prompt(every, args.prompts)
        summary["decode_by_prompt"] = decode_by_prompt(every, args.prompts)
        report += "\n\n" + prompt_table(summary["by_prompt"], peer, summary["decode_by_prompt"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(report + "\n")
    print(report)
    if "ar" in {m.name for m in methods} or peer:
        plot(levels, out / "throughput.png", peer)


def peer_servers(args, ap) -> list[tuple[str, LlamaServer]]:
    """One llama-server per --peer (not started yet) on the peers' GGUF files, with a slot per
    user at the largest user count; an unknown peer, a missing binary or file: an argument error."""
    from fly_serve.loading.loading import gguf_path
    from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

    out = []
    for spec in args.peer:
        try:
            m = parse_method(spec)
            if m.kind != "llama-server":
                raise ValueError(f"{spec!r} is not a llama-server peer (llama-server, llama-server-draft, ...)")
            draft = m.base == "llama-server-draft"
            server = LlamaServer(
                gguf_path(args.peer_target or DEFAULT_TARGET),
                draft=gguf_path(args.peer_drafter or DEFAULT_DRAFTER) if draft else None,
                threads=args.peer_threads,
                slots=max(args.users),
                context=args.peer_context,
                flags=m.options,
            )
        except (ValueError, LlamaServerMissing) as e:
            ap.error(f"--peer: {e}")
        out.append((spec, server))
    return out


if __name__ == "__main__":
    main()
