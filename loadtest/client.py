"""Requests to a live app whose every call has a timeout and ends in an Outcome (never raises):
one request, requests in flight, and the tally of how they ended."""

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import requests

CLIENT_TIMEOUT_S = 150.0  # a client waits this long for the next bytes; past it the call is hung


@dataclass
class Outcome:
    kind: str  # "ok" (200, complete), "error" (a clean error answer), "dropped" (connection cut), "hung"
    started: float  # time.monotonic()
    ended: float
    detail: str = ""
    body: dict | None = None  # the response, a stream's last chunk, or an error answer's JSON body
    longest_pause_s: float = 0.0  # a stream: the longest wait between two events
    status: int | None = None  # the HTTP status, when one came
    retry_after: str | None = None  # an error answer's Retry-After header (a 503 that sheds load says when to retry)

    @property
    def finished_normally(self) -> bool:
        """A whole answer: it ended by length or a stop, with tokens (a stream's last chunk too)."""
        if self.kind != "ok" or not self.body:
            return False
        choice = self.body["choices"][0]
        return choice["finish_reason"] in ("length", "stop") and self.body["usage"]["completion_tokens"] > 0

    @property
    def failure(self) -> str:
        """How a request failed, without what differs per request (its id): comparable across requests."""
        err = (self.body or {}).get("error") if self.kind == "error" else None
        if not isinstance(err, dict):
            return f"{self.kind}: {self.detail[:160]}"
        message = re.sub(r"request id \S+", "request id <id>", str(err.get("message")))[:160]
        return f"{self.status} {err.get('type')}/{err.get('code')}: {message}"


@dataclass
class Tally:
    """sent / answered / errored (a clean error) / dropped (connection cut) / hung."""

    sent: int = 0
    answered: int = 0
    errored: int = 0
    dropped: int = 0
    hung: int = 0

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> "Tally":
        names = {"ok": "answered", "error": "errored", "dropped": "dropped", "hung": "hung"}
        t = cls(sent=len(outcomes))
        for o in outcomes:
            setattr(t, names[o.kind], getattr(t, names[o.kind]) + 1)
        return t


def failures(outcomes: list[Outcome]) -> dict[str, int]:
    """Each way the failed requests failed, and how many failed that way."""
    out: dict[str, int] = {}
    for o in outcomes:
        if o.kind != "ok":
            out[o.failure] = out.get(o.failure, 0) + 1
    return out


def parse_sse(response: requests.Response) -> tuple[list[dict], bool, float]:
    """A stream's JSON events, whether it ended with [DONE], and the longest pause between events."""
    events, done, pause, last = [], False, 0.0, time.monotonic()
    for line in response.iter_lines(decode_unicode=True):
        if not line:
            continue
        now = time.monotonic()
        pause, last = max(pause, now - last), now
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        events.append(json.loads(data))
    return events, done, pause


def _json_or_none(r: requests.Response) -> dict | None:
    try:
        body = r.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def complete(
    url: str, body: dict, stream: bool = False, path: str = "/v1/completions", timeout_s: float = CLIENT_TIMEOUT_S
) -> Outcome:
    """One request; never raises: how it ended is the outcome. No bytes within timeout_s: hung."""
    t0 = time.monotonic()
    try:
        with requests.post(f"{url}{path}", json={**body, "stream": stream}, stream=stream, timeout=timeout_s) as r:
            if r.status_code != 200:
                detail, end = f"{r.status_code} {r.text[:300]}", time.monotonic()
                retry = r.headers.get("Retry-After")
                return Outcome("error", t0, end, detail, _json_or_none(r), status=r.status_code, retry_after=retry)
            if not stream:
                return Outcome("ok", t0, time.monotonic(), body=r.json(), status=200)
            events, done, pause = parse_sse(r)
    except requests.Timeout as e:
        return Outcome("hung", t0, time.monotonic(), repr(e))
    except requests.ConnectionError as e:  # ChunkedEncodingError too: the connection was cut
        return Outcome("dropped", t0, time.monotonic(), repr(e))
    errors = [e for e in events if "error" in e]
    if errors:
        return Outcome("error", t0, time.monotonic(), json.dumps(errors[0])[:300], errors[0], pause, 200)
    if not done:
        return Outcome("dropped", t0, time.monotonic(), "the stream ended without [DONE]", None, pause, 200)
    return Outcome("ok", t0, time.monotonic(), body=events[-1] if events else None, longest_pause_s=pause, status=200)


def post_raw(url: str, raw: bytes, path: str = "/v1/completions", timeout_s: float = CLIENT_TIMEOUT_S) -> Outcome:
    """One request whose body is these bytes as they are (JSON no client library would write:
    nested past any parser's depth); never raises."""
    t0 = time.monotonic()
    headers = {"content-type": "application/json"}
    try:
        r = requests.post(f"{url}{path}", data=raw, headers=headers, timeout=timeout_s)
    except requests.Timeout as e:
        return Outcome("hung", t0, time.monotonic(), repr(e))
    except requests.ConnectionError as e:
        return Outcome("dropped", t0, time.monotonic(), repr(e))
    kind = "ok" if r.status_code == 200 else "error"
    return Outcome(
        kind, t0, time.monotonic(), f"{r.status_code} {r.text[:300]}", _json_or_none(r), status=r.status_code
    )


class InFlight:
    """n_plain + n_stream requests sent at once (plain first), each on its own thread."""

    def __init__(self, url: str, body: dict, n_plain: int = 2, n_stream: int = 1, timeout_s: float = CLIENT_TIMEOUT_S):
        self.pool = ThreadPoolExecutor(n_plain + n_stream)
        kinds = [False] * n_plain + [True] * n_stream
        self.futures: list[Future] = [self.pool.submit(complete, url, body, s, timeout_s=timeout_s) for s in kinds]

    def __len__(self) -> int:
        return len(self.futures)

    def gather(self, timeout_s: float) -> list[Outcome]:
        """Every request's outcome within timeout_s; one still running then counts as hung (its
        thread is left behind: a client that never returns must not stop the run)."""
        t0 = time.monotonic()
        wait_futures(self.futures, timeout=timeout_s)
        now = time.monotonic()
        out = [
            f.result() if f.done() else Outcome("hung", t0, now, f"no outcome within {timeout_s:g} s")
            for f in self.futures
        ]
        self.pool.shutdown(wait=False, cancel_futures=True)
        return out

    def close(self) -> None:
        """Wait no more (a test that failed midway): each request's thread ends with its request,
        within the client's timeout."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def stats(url: str, timeout_s: float = 10.0, headers: dict | None = None) -> dict:
    """The ingress's /v1/fly/stats (running, waiting, in_flight, rounds, drafter_cache, ...)."""
    return requests.get(f"{url}/v1/fly/stats", headers=headers, timeout=timeout_s).json()


def healthz(url: str, timeout_s: float = 5.0) -> int | None:
    """/healthz's status; None when it did not answer."""
    try:
        return requests.get(f"{url}/healthz", timeout=timeout_s).status_code
    except requests.RequestException:
        return None
