"""A long run against a running app: N requests through the `openai` client at a fixed concurrency,
a mix of plain and streaming completions and chats, clients that give up early, and bad inputs;
resident memory of the app's processes at the start and the end.

    fly-serve serve --tiny &                                     # or the default profile
    python -m loadtest.soak --requests 500 --concurrency 8       # prints one JSON summary

Every request ends in one of: "answered" (200, a whole answer), "rejected" (the 4xx a bad input
must get), "shed" (503 at capacity, with our error body), "client_left" (a client that gave up
on purpose), "hung" (no answer within --timeout-s), "unexpected" (anything else: a 5xx, a wrong
status, a stream that ended without finish_reason). A sound server has no "hung" and no
"unexpected". Processes: the app's Ray processes (replicas, TP ranks, the HTTP proxy) are found
under the server process (--server-pid, else the one whose descendant listens on the URL's port)
and their RSS is read from /proc (psutil) once before the first request and once after the last,
when the app is idle again.
"""

import argparse
import json
import random
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import requests

from fly_bench.prompts import SOAK as PROMPTS

from .client import stats
from .procs import app_processes, rss_mib, server_pid_for
from .waits import wait_idle

# The kinds of request and their weights in the mix; each request's kind is drawn with --seed.
MIX = {
    "complete": 3,
    "chat": 2,
    "stream_complete": 2,
    "stream_chat": 2,
    "leave_early": 1,  # a client timeout of --early-timeout-s, shorter than the answer takes
    "bad_input": 1,
}
# Bad inputs and the status each must get (never a 5xx, never a hang).
BAD_INPUTS = [
    ("fly.k = 0", {"fly": {"k": 0}}, 400),
    ("token id past the vocabulary", {"prompt": [10**9]}, 400),
    ("negative token id", {"prompt": [-1]}, 400),
    ("max_tokens past the context", {"max_tokens": 10**7}, 400),
    ("lone surrogate", {"prompt": "a\ud800b"}, 400),
    ("unknown model", {"model": "no-such-model"}, 404),
    ("unknown fly knob", {"fly": {"nope": 1}}, 400),
    ("n = 2", {"n": 2}, 400),
]
IDLE_WAIT_S = 60.0


@dataclass
class Result:
    kind: str  # the request's kind (MIX)
    outcome: str  # answered, rejected, shed, client_left, hung, unexpected
    seconds: float
    detail: str = ""
    tokens: int = 0


# ---- requests
def transport_error(e: BaseException, name: str) -> bool:
    """Whether e is the openai client's transport error `name` (HTTPError, TimeoutException). The
    transport is httpx in openai 1.x-2.x and httpx2 in 3.x, with the same class names: matched by
    name, so this script works with either and needs neither installed by name."""
    return any(c.__name__ == name for c in type(e).__mro__)


class Client:
    def __init__(self, url: str, api_key: str | None, timeout_s: float, max_tokens: int):
        self.base = url.rstrip("/") + "/v1"
        self.key = api_key or "none"
        self.timeout_s, self.max_tokens = timeout_s, max_tokens
        self.openai = openai.OpenAI(base_url=self.base, api_key=self.key, max_retries=0, timeout=timeout_s)
        self.model = self.openai.models.list().data[0].id

    def run(self, i: int, kind: str, rng: random.Random, early_timeout_s: float) -> Result:
        t0 = time.monotonic()
        try:
            outcome, detail, tokens = getattr(self, f"_{kind}")(i, rng, early_timeout_s)
        except openai.APIStatusError as e:
            outcome, detail, tokens = self._status(e), f"{e.status_code} {e.message[:200]}", 0
        except Exception as e:
            if not (isinstance(e, openai.APIError) or transport_error(e, "HTTPError")):
                raise  # a bug of this script, not an outcome of the request
            # a stream's read timeout comes from the client's transport, unwrapped, while it
            # iterates the events; any other error is an error event mid-stream or a cut connection
            timed_out = isinstance(e, openai.APITimeoutError) or transport_error(e, "TimeoutException")
            outcome = ("client_left" if kind == "leave_early" else "hung") if timed_out else "unexpected"
            detail, tokens = repr(e)[:200], 0
        return Result(kind, outcome, time.monotonic() - t0, detail, tokens)

    @staticmethod
    def _status(e: openai.APIStatusError) -> str:
        """A status error on a request that should have been answered: 503 at capacity is shed
        (if it is our error body), anything else is unexpected."""
        try:
            ours = e.status_code == 503 and e.response.json()["error"]["code"] in ("overloaded", "draining")
        except Exception:
            ours = False
        return "shed" if ours else "unexpected"

    def _params(self, i: int, rng: random.Random) -> dict:
        return {"model": self.model, "max_tokens": rng.randint(1, self.max_tokens), "seed": i}

    def _complete(self, i, rng, _):
        r = self.openai.completions.create(prompt=rng.choice(PROMPTS), **self._params(i, rng))
        return self._whole(r.choices[0].finish_reason, r.usage.completion_tokens)

    def _chat(self, i, rng, _):
        messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
        r = self.openai.chat.completions.create(messages=messages, **self._params(i, rng))
        return self._whole(r.choices[0].finish_reason, r.usage.completion_tokens)

    def _stream_complete(self, i, rng, _):
        stream = self.openai.completions.create(
            prompt=rng.choice(PROMPTS), stream=True, stream_options={"include_usage": True}, **self._params(i, rng)
        )
        return self._stream(stream)

    def _stream_chat(self, i, rng, _):
        messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
        stream = self.openai.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **self._params(i, rng)
        )
        return self._stream(stream)

    def _stream(self, stream):
        finish, tokens = None, 0
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        return self._whole(finish, tokens)

    @staticmethod
    def _whole(finish_reason, tokens: int):
        if finish_reason in ("stop", "length") and tokens > 0:
            return "answered", "", tokens
        return "unexpected", f"finish_reason={finish_reason} tokens={tokens}", tokens

    def _leave_early(self, i, rng, early_timeout_s):
        """Asks for the most tokens with a short client timeout: it usually leaves mid-generation."""
        quick = self.openai.with_options(timeout=early_timeout_s)
        stream = rng.random() < 0.5
        params = self._params(i, rng) | {"max_tokens": self.max_tokens}
        if stream:
            return self._stream(quick.completions.create(prompt=rng.choice(PROMPTS), stream=True, **params))
        r = quick.completions.create(prompt=rng.choice(PROMPTS), **params)
        return self._whole(r.choices[0].finish_reason, r.usage.completion_tokens)

    def _bad_input(self, i, rng, _):
        name, change, status = BAD_INPUTS[i % len(BAD_INPUTS)]
        body = {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": 4} | change
        r = requests.post(
            f"{self.base}/completions",
            data=json.dumps(body).encode(),  # json.dumps escapes a lone surrogate, as a client would send it
            headers={"content-type": "application/json", "authorization": f"Bearer {self.key}"},
            timeout=self.timeout_s,
        )
        try:
            err = r.json().get("error") or {}
        except ValueError:
            err = {}
        if r.status_code == status and err.get("message"):
            return "rejected", f"{name}: {r.status_code} {err.get('param')}", 0
        return "unexpected", f"{name}: {r.status_code} {r.text[:200]}", 0


def summarize(results: list[Result]) -> dict:
    counts: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
        kind = by_kind.setdefault(r.kind, {})
        kind[r.outcome] = kind.get(r.outcome, 0) + 1
    answered = sorted(r.seconds for r in results if r.outcome == "answered")
    latency = {}
    if answered:
        latency = {
            "p50": round(statistics.median(answered), 3),
            "p95": round(answered[int(0.95 * (len(answered) - 1))], 3),
            "max": round(answered[-1], 3),
        }
    bad = [f"{r.kind}: {r.detail}" for r in results if r.outcome in ("unexpected", "hung")]
    return {"outcomes": counts, "by_kind": by_kind, "answered_latency_s": latency, "problems": bad[:20]}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="each request asks for 1..this many tokens")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request with no answer by then is hung")
    p.add_argument("--early-timeout-s", type=float, default=0.3, help="the timeout of clients that leave early")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-pid", type=int, default=None, help="default: found from the URL's port")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if urllib.parse.urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
        p.error("--url: the soak runs against a local server only (127.0.0.1)")
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    client = Client(args.url, args.api_key, args.timeout_s, args.max_tokens)
    server = args.server_pid or server_pid_for(args.url)
    pids = app_processes(server) if server else {}
    rss_start = rss_mib(pids)
    rng = random.Random(args.seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=args.requests)
    seeds = [rng.randrange(2**31) for _ in kinds]
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(
            pool.map(
                lambda i: client.run(i, kinds[i], random.Random(seeds[i]), args.early_timeout_s), range(len(kinds))
            )
        )
    wall_s = time.monotonic() - t0
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    idle = wait_idle(url, IDLE_WAIT_S, headers) or stats(url, headers=headers)
    rss_end = rss_mib(pids)
    out = {
        "url": args.url,
        "model": client.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall_s, 1),
        **summarize(results),
        "completion_tokens": sum(r.tokens for r in results),
        "after": {k: idle[k] for k in ("running", "waiting", "in_flight", "finished", "status")},
        "server_pid": server,
        "rss_mib_start": rss_start,
        "rss_mib_end": rss_end,
        "rss_mib_growth": {k: round(rss_end[k] - v, 1) for k, v in rss_start.items() if k in rss_end},
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
