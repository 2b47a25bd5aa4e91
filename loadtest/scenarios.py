"""The fault scenarios, each a function that drives a live app and returns what happened as a
dataclass: tests/test_faults.py asserts on the results, fault_run.py prints them (summary()).

  drafter_kill   the drafter replica SIGKILLed mid-generation (2 plain + 1 streaming in flight)
  tp_rank_kill   one TP rank of the target SIGKILLed mid-generation
  overload       more concurrent requests than the batch and the queue hold
  sigterm_drain  SIGTERM to `fly-serve serve` with requests in flight (the server is this run's child)
  hostile        hostile input beside requests in flight: JSON nested past the parser, grammars the
                 library cannot follow or that no text completes (at once, or only after 51 tokens),
                 stop lists past OpenAI's bound, lone surrogates in a grammar, and more slow bodies
                 than the replica has slots (each must be a 4xx; the requests in flight end whole)
  slow_flood     3x the ingress's Serve limit (max_ongoing_requests) in sockets that send headers and
                 dribble a body: /healthz latency and a streamed request's time to first token
                 beside them against the same idle, and nothing lost

Pids come from procs.replica_pids (the process tree under App.root_pid) and only processes this
process started are killed (procs.kill_ours). Every request has a client timeout; every wait
goes through waits.until with a deadline.
"""

import http.client
import json
import signal
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

import requests

from .client import CLIENT_TIMEOUT_S, InFlight, Outcome, Tally, complete, failures, post_raw, stats
from .procs import alive, kill_ours, replica_pids
from .server import ServeProcess
from .waits import HealthWatch, probe_until, until, wait_generating, wait_status

PROMPT = "def add(a, b):\n    return"
N_LATER = 3  # requests after a recovery, to show it holds


class ScenarioError(RuntimeError):
    """The app is not in the shape the scenario needs (no drafter replica, no TP ranks)."""


@dataclass
class App:
    """A live app and the run's limits."""

    url: str
    root_pid: int  # the app's processes descend from it: a `fly-serve serve` child, or this process
    timeout_s: float = CLIENT_TIMEOUT_S  # a request with no answer by then is hung
    recovery_timeout_s: float = 180.0


def _after(outcomes: list[Outcome], t: float) -> list[float]:
    return [round(o.ended - t, 1) for o in outcomes]


def _drafter_forwards(url: str) -> int | None:
    """The drafter's model forwards, through the ingress's stats; None while no replica answers."""
    cache = stats(url).get("drafter_cache")
    return None if cache is None else cache["forwards"]


# ---- the drafter replica SIGKILLed
@dataclass
class DrafterKill:
    old_pid: int
    new_pid: int | None
    t_kill: float
    in_flight: list[Outcome]  # plain first, the stream last
    recovery_s: float | None  # from the kill until a new replica drafted with the model
    while_recovering: list[Outcome]  # requests sent once the in-flight ones had ended, until then
    later: list[Outcome]  # after the recovery
    forwards_before_later: int | None
    forwards_after_later: int | None
    old_pid_alive: bool

    def summary(self) -> dict:
        return {
            "in_flight": asdict(Tally.of(self.in_flight)),
            "in_flight_ended_before_kill": sum(o.ended <= self.t_kill for o in self.in_flight),
            "in_flight_ended_s_after_kill": _after(self.in_flight, self.t_kill),
            "in_flight_finished_normally": sum(o.finished_normally for o in self.in_flight),
            "in_flight_errors": failures(self.in_flight),
            "stream_longest_pause_s": round(self.in_flight[-1].longest_pause_s, 1),
            "recovery_s": self.recovery_s,
            "drafter_pid": f"{self.old_pid} -> {self.new_pid}",
            "old_pid_alive": self.old_pid_alive,
            "requests_while_recovering": asdict(Tally.of(self.while_recovering)),
            "errors_while_recovering": failures(self.while_recovering),
            "later_requests": asdict(Tally.of(self.later)),
            "later_errors": failures(self.later),
            "later_drafted": [o.body["fly"]["drafted"] for o in self.later if o.kind == "ok"],
            "drafter_forwards_during_later": None
            if None in (self.forwards_before_later, self.forwards_after_later)
            else self.forwards_after_later - self.forwards_before_later,
        }


def drafter_kill(app: App, inflight_tokens: int, probe_tokens: int) -> DrafterKill:
    old = replica_pids(app.root_pid, "FlyDrafter")
    if len(old) != 1:
        raise ScenarioError(f"expected one drafter replica, found pids {old}")
    # small k and window: each request takes many rounds, so it is still running when the kill comes
    fly = {"mode": "fly", "k": 2, "window": 1}
    flight = InFlight(app.url, {"prompt": PROMPT, "max_tokens": inflight_tokens, "fly": fly}, timeout_s=app.timeout_s)
    wait_generating(app.url, len(flight), timeout_s=app.timeout_s, rounds=2)
    t_kill = time.monotonic()
    kill_ours(old[0])
    probe = {"prompt": PROMPT, "max_tokens": probe_tokens, "fly": fly}
    waiting: list[Outcome] = []
    new_pid: list[int] = []

    def drafting_again():
        """A replica other than the killed one that has drafted; once the in-flight requests have
        ended, one more request per check gives the new replica rounds to draft in."""
        pids = replica_pids(app.root_pid, "FlyDrafter")
        if pids and pids[-1] != old[0]:
            new_pid[:] = pids[-1:]
            if (_drafter_forwards(app.url) or 0) > 0:
                return time.monotonic()
        if all(f.done() for f in flight.futures):
            waiting.append(complete(app.url, probe, timeout_s=app.timeout_s))
        return None

    back_at = until(drafting_again, app.recovery_timeout_s)
    in_flight = flight.gather(app.timeout_s + 30)
    before = until(lambda: _drafter_forwards(app.url), 30)
    later = [complete(app.url, probe, timeout_s=app.timeout_s) for _ in range(N_LATER)]
    after = until(lambda: _drafter_forwards(app.url), 30)
    return DrafterKill(
        old[0],
        new_pid[0] if new_pid else None,
        t_kill,
        in_flight,
        None if back_at is None else round(back_at - t_kill, 1),
        waiting,
        later,
        before,
        after,
        alive(old[0]),
    )


# ---- one TP rank SIGKILLed
@dataclass
class RankKill:
    old_ranks: list[int]
    killed: int
    new_ranks: list[int]
    old_replica: list[int]  # the target replica's pid (the group's driver)
    new_replica: list[int]
    t_kill: float
    in_flight: list[Outcome]
    healthz_changes: list[tuple[float, int | None]]  # (seconds after the kill, status)
    until_success: list[Outcome]  # requests after the in-flight ones, the last one the first success
    later: list[Outcome]

    @property
    def recovery_s(self) -> float | None:
        """From the kill until the first request succeeded again."""
        ok = [o for o in self.until_success if o.kind == "ok"]
        return round(ok[0].ended - self.t_kill, 1) if ok else None

    def healthz_first(self, status: int | None, after_s: float = 0.0) -> float | None:
        return next((round(t, 1) for t, s in self.healthz_changes if s == status and t >= after_s), None)

    def summary(self) -> dict:
        went = self.healthz_first(503)
        return {
            "killed_rank_pid": self.killed,
            "in_flight": asdict(Tally.of(self.in_flight)),
            "in_flight_ended_before_kill": sum(o.ended <= self.t_kill for o in self.in_flight),
            "in_flight_ended_s_after_kill": _after(self.in_flight, self.t_kill),
            "in_flight_errors": failures(self.in_flight),
            "healthz_503_s": went,
            "healthz_200_again_s": None if went is None else self.healthz_first(200, after_s=went),
            "healthz_changes": [[round(t, 1), s] for t, s in self.healthz_changes],
            "first_success_s": self.recovery_s,
            "requests_until_success": asdict(Tally.of(self.until_success)),
            "errors_until_success": failures(self.until_success),
            "later_requests": asdict(Tally.of(self.later)),
            "later_errors": failures(self.later),
            "rank_pids": f"{self.old_ranks} -> {self.new_ranks}",
            "target_replica_pid": f"{self.old_replica} -> {self.new_replica}",
            "old_ranks_alive": [p for p in self.old_ranks if alive(p)],
        }


def tp_rank_kill(app: App, inflight_tokens: int, probe_tokens: int) -> RankKill:
    old_ranks = replica_pids(app.root_pid, "TPWorker")
    if len(old_ranks) < 2:
        raise ScenarioError(f"expected TP ranks (tp_size > 1), found pids {old_ranks}")
    old_replica = replica_pids(app.root_pid, "FlyTarget")
    body = {"prompt": PROMPT, "max_tokens": inflight_tokens, "fly": {"mode": "ar"}}
    flight = InFlight(app.url, body, timeout_s=app.timeout_s)
    wait_generating(app.url, len(flight), timeout_s=app.timeout_s, rounds=2)
    health = HealthWatch(app.url)
    t_kill = health.t0
    kill_ours(old_ranks[-1])
    try:
        in_flight = flight.gather(app.timeout_s + 30)
        probe = {"prompt": PROMPT, "max_tokens": probe_tokens, "fly": {"mode": "ar"}}
        left = app.recovery_timeout_s - (time.monotonic() - t_kill)
        probes = probe_until(app.url, probe, lambda ps: bool(ps) and ps[-1].kind == "ok", left, app.timeout_s)
    finally:
        health.close()
    ok = bool(probes) and probes[-1].kind == "ok"
    later = [complete(app.url, probe, timeout_s=app.timeout_s) for _ in range(N_LATER)] if ok else []
    return RankKill(
        old_ranks,
        old_ranks[-1],
        replica_pids(app.root_pid, "TPWorker"),
        old_replica,
        replica_pids(app.root_pid, "FlyTarget"),
        t_kill,
        in_flight,
        list(health.changes),
        probes,
        later,
    )


# ---- overload
@dataclass
class Overload:
    concurrent: int
    max_batch: int
    max_waiting: int
    outcomes: list[Outcome]
    wall_s: float

    def summary(self) -> dict:
        counts = {"200": 0, "503": 0, "other": 0, "hung": 0}
        codes: dict[str, int] = {}
        for o in self.outcomes:
            key = "hung" if o.kind == "hung" else "200" if o.kind == "ok" else "503" if o.status == 503 else "other"
            counts[key] += 1
            if key == "503":
                code = str(((o.body or {}).get("error") or {}).get("code"))
                codes[code] = codes.get(code, 0) + 1
        seconds = {k: [o.ended - o.started for o in self.outcomes if o.status == int(k)] for k in ("200", "503")}
        return {
            "concurrent": self.concurrent,
            "max_batch": self.max_batch,
            "max_waiting": self.max_waiting,
            "counts": counts,
            "503_error_codes": codes,
            "max_s": {k: round(max(v), 2) if v else None for k, v in seconds.items()},
            "other": failures([o for o in self.outcomes if o.kind != "ok" and o.status != 503]),
            "wall_s": round(self.wall_s, 1),
        }


def overload(app: App, max_batch: int, max_waiting: int, max_tokens: int) -> Overload:
    """4 x max_batch + max_waiting short requests at once: the excess must get a 503, none may hang."""
    n = 4 * max_batch + max_waiting
    t0 = time.monotonic()
    flight = InFlight(
        app.url, {"prompt": PROMPT, "max_tokens": max_tokens}, n_plain=n, n_stream=0, timeout_s=app.timeout_s
    )
    outcomes = flight.gather(app.timeout_s + 30)
    return Overload(n, max_batch, max_waiting, outcomes, time.monotonic() - t0)


# ---- SIGTERM to the server with requests in flight
@dataclass
class Drain:
    t_term: float
    in_flight: list[Outcome]  # one plain, one stream
    healthz_503_s: float | None  # from SIGTERM until /healthz said 503 (draining)
    refused: Outcome  # a request sent while draining
    exit_code: int | None  # None: it did not exit within the grace period and the shutdown
    exit_s: float
    log: list[str]  # the server's own "fly-serve:" lines

    def summary(self) -> dict:
        return {
            "requests": asdict(Tally.of(self.in_flight)),
            "finished_s_after_term": _after(self.in_flight, self.t_term),
            "stream_longest_pause_s": round(self.in_flight[-1].longest_pause_s, 1),
            "healthz_503_s_after_term": self.healthz_503_s,
            "request_after_term": f"{self.refused.kind} {self.refused.detail[:80]}",
            "exit_code": self.exit_code,
            "exit_s_after_term": round(self.exit_s, 1),
            "log": self.log,
        }


def sigterm_drain(server: ServeProcess, inflight_tokens: int, exit_timeout_s: float) -> Drain:
    """The server must finish what it holds, refuse new work with a 503 meanwhile, and exit 0."""
    body = {"prompt": PROMPT, "max_tokens": inflight_tokens, "fly": {"mode": "ar"}}
    flight = InFlight(server.url, body, n_plain=1, n_stream=1)
    wait_generating(server.url, len(flight))
    t_term = time.monotonic()
    kill_ours(server.pid, signal.SIGTERM)
    # once the ingress drains, /healthz says so and new requests are turned away
    draining = wait_status(server.url, 503, timeout_s=10)
    refused = complete(server.url, {"prompt": PROMPT, "max_tokens": 4})
    in_flight = flight.gather(CLIENT_TIMEOUT_S)
    rc = until(lambda: server.proc.poll(), exit_timeout_s)
    return Drain(
        t_term,
        in_flight,
        None if draining is None else round(draining - t_term, 1),
        refused,
        rc,
        time.monotonic() - t_term,
        [line for line in server.lines if line.startswith("fly-serve:")],
    )


# ---- hostile input (issue 47)
BODY_TIMEOUT_S = 20.0  # the app's body deadline where its profile sets none (deployments/profiles/app_args.py)
# Bodies nested past any JSON parser's depth: a 400, never a 500.
NESTED_BODIES = {
    "nested_array": b"[" * 100_000 + b"]" * 100_000,
    "nested_in_unknown_field": b'{"prompt": "x", "junk": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}
# Grammars the library fails on at their first token, or that no text completes: a 400 naming the
# field, never a 200 "stop" with no text.
A_MILLION_AS = {"type": "string", "pattern": "^a{1000000}$"}
GRAMMAR_FAILURES = {
    "pattern_of_a_million": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": A_MILLION_AS}}
    },
    "regex_of_a_million": {"fly": {"regex": "(a{1000}){1000}"}},
    "grammar_no_text_completes": {"fly": {"grammar": "start: x\nx: x"}},
    "refs_that_only_loop": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    },
    "lone_surrogate_in_a_regex": {"fly": {"regex": "a\ud800b"}},
    "lone_surrogate_in_a_grammar": {"fly": {"grammar": 'start: "\ud800"'}},
}
# A 51-character literal, then a rule no text completes: admission's walk (8 tokens) passes it, the
# generation meets the dead end (issue 54: a 500 "generation failed"). Each case must be a 400
# naming fly.grammar, a stream's last event of type invalid_request_error.
LATE_DEAD_END = {"fly": {"mode": "ar", "grammar": 'start: "' + "a" * 51 + '" x\nx: x "b"'}, "max_tokens": 80}
# stop lists past OpenAI's bound (4 strings; here 512 characters each): a 400 naming stop; at the
# bound: served. The last one is the cost case, 1,000 strings of 3.5 KB (3.5 MB of body).
STOP_CASES = {
    "five_stops": (["a", "b", "c", "d", "e"], 400),
    "a_stop_of_513_characters": (["x" * 513], 400),
    "a_thousand_stops_of_3500_characters": (["y" * 3500] * 1000, 400),
    "four_stops_of_512_characters": (["z" * 512] * 4, 200),
}


@dataclass
class SlowBody:
    status: int | None  # None: no answer (the socket timed out or was cut)
    code: str | None  # the error body's code ("request_timeout")
    seconds: float  # from when the socket was opened until its answer


@dataclass
class Hostile:
    slots: int  # max_batch + max_waiting of the app
    body_timeout_s: float
    in_flight: list[Outcome]  # generations in flight through all of it (plain first, the stream last)
    nested: dict[str, Outcome]
    grammar: dict[str, Outcome]
    stops: dict[str, Outcome]
    dead_end: dict[str, Outcome]  # "plain", "stream"
    slow: list[SlowBody]  # more sockets than slots, each declaring a body it never sends
    beside_slow: list[Outcome]  # requests sent while the slow bodies were held

    def summary(self) -> dict:
        def status(o: Outcome) -> str:
            return f"{o.status} {((o.body or {}).get('error') or {}).get('param')}" if o.status else o.kind

        def event(o: Outcome) -> str:  # a stream's last event: its status, and the error's type and field
            err = (o.body or {}).get("error") or {}
            return f"{o.status} {err.get('type')} {err.get('param')}" if err else status(o)

        return {
            "in_flight": asdict(Tally.of(self.in_flight)),
            "in_flight_finished_normally": sum(o.finished_normally for o in self.in_flight),
            "in_flight_errors": failures(self.in_flight),
            "nested": {name: status(o) for name, o in self.nested.items()},
            "grammar": {name: status(o) for name, o in self.grammar.items()},
            "stops": {name: status(o) for name, o in self.stops.items()},
            "late_dead_end": {name: event(o) for name, o in self.dead_end.items()},
            "slow_bodies": len(self.slow),
            "slow_statuses": sorted({f"{b.status} {b.code}" for b in self.slow}),
            "slow_answered_s": [round(b.seconds, 1) for b in self.slow],
            "beside_slow": asdict(Tally.of(self.beside_slow)),
            "beside_slow_errors": failures(self.beside_slow),
            "slots": self.slots,
            "body_timeout_s": self.body_timeout_s,
            "status_500": self.server_errors,
        }

    @property
    def server_errors(self) -> int:
        """Answers with a 5xx status (or a stream's server_error event) among the hostile requests."""
        hostile = [*self.nested.values(), *self.grammar.values(), *self.stops.values(), *self.dead_end.values()]
        return sum(
            (o.status or 0) >= 500 or ((o.body or {}).get("error") or {}).get("type") == "server_error" for o in hostile
        )

    @property
    def held(self) -> bool:
        """Every hostile request got its 4xx, and nothing beside them was lost."""
        refused = all(o.status == 400 for o in [*self.nested.values(), *self.grammar.values()])
        stops = all(self.stops[name].status == want for name, (_, want) in STOP_CASES.items())
        dead = self.dead_end["plain"].status == 400 and all(
            ((o.body or {}).get("error") or {}).get("param") == "fly.grammar" for o in self.dead_end.values()
        )
        dead = dead and ((self.dead_end["stream"].body or {}).get("error") or {}).get("type") == "invalid_request_error"
        cut = all(b.status == 408 for b in self.slow)
        whole = all(o.finished_normally for o in self.in_flight) and all(o.kind == "ok" for o in self.beside_slow)
        return refused and stops and dead and cut and whole and self.server_errors == 0


def _slow_body(url: str, timeout_s: float) -> socket.socket:
    """A POST that declares 200 bytes of body and sends a few of them."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=timeout_s)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: 200\r\n\r\n".encode() + b'{"prompt": ')
    return s


def _answer(s: socket.socket, t0: float) -> SlowBody:
    try:
        response = http.client.HTTPResponse(s)
        response.begin()
        body = response.read()
        code = ((json.loads(body) if body else {}).get("error") or {}).get("code")
        return SlowBody(response.status, code, time.monotonic() - t0)
    except (OSError, http.client.HTTPException, ValueError):
        return SlowBody(None, None, time.monotonic() - t0)
    finally:
        s.close()


def slow_bodies(app: App, n: int, body_timeout_s: float, probe_tokens: int) -> tuple[list[SlowBody], list[Outcome]]:
    """n sockets that never finish their body, then two short requests beside them (answered:
    a body being read holds no slot), then each socket's answer (a 408 after body_timeout_s)."""
    t0 = time.monotonic()
    sockets = [_slow_body(app.url, body_timeout_s + 60) for _ in range(n)]
    time.sleep(0.5)  # each is in a handler, reading its body
    beside = [
        complete(app.url, {"prompt": PROMPT, "max_tokens": probe_tokens}, timeout_s=app.timeout_s) for _ in range(2)
    ]
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda s: _answer(s, t0), sockets))
    return answers, beside


def hostile_input(app: App, slots: int, body_timeout_s: float, inflight_tokens: int, probe_tokens: int) -> Hostile:
    """The hostile requests of issue 47, one kind after the other, while one plain and one
    streamed generation run: nested JSON, grammar failures, and slots + 4 slow bodies."""
    body = {"prompt": PROMPT, "max_tokens": inflight_tokens, "fly": {"mode": "ar"}}
    flight = InFlight(app.url, body, n_plain=1, n_stream=1, timeout_s=app.timeout_s)
    wait_generating(app.url, len(flight), timeout_s=app.timeout_s, rounds=2)
    nested = {name: post_raw(app.url, raw, timeout_s=app.timeout_s) for name, raw in NESTED_BODIES.items()}
    grammar = {
        name: complete(app.url, {"prompt": PROMPT, "max_tokens": probe_tokens, **extra}, timeout_s=app.timeout_s)
        for name, extra in GRAMMAR_FAILURES.items()
    }
    stops = {
        name: complete(app.url, {"prompt": PROMPT, "max_tokens": probe_tokens, "stop": stop}, timeout_s=app.timeout_s)
        for name, (stop, _) in STOP_CASES.items()
    }
    dead_end = {
        kind: complete(app.url, {"prompt": PROMPT, **LATE_DEAD_END}, stream=kind == "stream", timeout_s=app.timeout_s)
        for kind in ("plain", "stream")
    }
    slow, beside = slow_bodies(app, slots + 4, body_timeout_s, probe_tokens)
    in_flight = flight.gather(app.timeout_s + 30)
    return Hostile(slots, body_timeout_s, in_flight, nested, grammar, stops, dead_end, slow, beside)


# ---- slow bodies past the ingress's Serve limit (issue 54)
FLOOD_FACTOR = 3  # sockets per place of the ingress's max_ongoing_requests
HEALTHZ_GOAL_S = 2.0  # /healthz p99 beside the flood (the goal)
TTFT_GOAL_RATIO = 2.0  # a request's time to first token beside the flood, over its idle value
N_HEALTHZ, N_TTFT = 20, 3


def first_token_s(url: str, body: dict, timeout_s: float) -> tuple[float | None, Outcome]:
    """A streamed request's time to its first text, and how it ended (None: no text came)."""
    t0, first = time.monotonic(), None
    try:
        with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                return None, Outcome("error", t0, time.monotonic(), r.text[:300], status=r.status_code)
            events, done = [], False
            for line in r.iter_lines(decode_unicode=True):
                data = (line or "").removeprefix("data: ")
                if not data:
                    continue
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
                if first is None and (events[-1].get("choices") or [{}])[0].get("text"):
                    first = time.monotonic() - t0
    except requests.Timeout as e:
        return first, Outcome("hung", t0, time.monotonic(), repr(e))
    except requests.ConnectionError as e:
        return first, Outcome("dropped", t0, time.monotonic(), repr(e))
    errors = [e for e in events if "error" in e]
    kind = "error" if errors else "ok" if done else "dropped"
    return first, Outcome(kind, t0, time.monotonic(), body=(errors or events or [None])[-1], status=200)


def healthz_s(url: str, timeout_s: float) -> float | None:
    """/healthz's answer time when it said 200 within timeout_s, else None."""
    t0 = time.monotonic()
    try:
        ok = requests.get(f"{url}/healthz", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        ok = False
    return time.monotonic() - t0 if ok else None


def p99(values: list[float | None]) -> float | None:
    """The 99th percentile (nearest rank); None if any value is missing (no answer)."""
    if not values or None in values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, -(-99 * len(ordered) // 100) - 1)], 3)


@dataclass
class SlowFlood:
    ongoing_limit: int  # the ingress's Serve max_ongoing_requests
    healthz_idle: list[float | None]
    ttft_idle: list[float | None]  # before the flood and after it (the machine's drift shows in both)
    slow: list[SlowBody]  # FLOOD_FACTOR x ongoing_limit sockets
    healthz_beside: list[float | None]
    ttft_beside: list[float | None]
    streams: list[Outcome]  # the idle and beside streams, in order
    beside: list[Outcome]  # plain requests beside the flood

    def summary(self) -> dict:
        idle = statistics.median([t for t in self.ttft_idle if t is not None] or [0.0])
        worst = max((t for t in self.ttft_beside if t is not None), default=None)
        healthz = p99(self.healthz_beside)
        lost = [o for o in [*self.streams, *self.beside] if not o.finished_normally]
        ratio = None if worst is None or idle <= 0 else round(worst / idle, 2)
        return {
            "ongoing_limit": self.ongoing_limit,
            "slow_sockets": len(self.slow),
            "slow_statuses": sorted({f"{b.status} {b.code}" for b in self.slow}),
            "slow_answered_s_min_max": [round(f((b.seconds for b in self.slow), default=0), 1) for f in (min, max)],
            "healthz_p99_idle_s": p99(self.healthz_idle),
            "healthz_p99_beside_s": healthz,
            "ttft_idle_median_s": round(idle, 3),
            "ttft_beside_s": [None if t is None else round(t, 3) for t in self.ttft_beside],
            "ttft_ratio": ratio,
            "requests_lost": len(lost),
            "lost": failures(lost),
            "goals": {
                f"healthz_p99_le_{HEALTHZ_GOAL_S:g}s": healthz is not None and healthz <= HEALTHZ_GOAL_S,
                f"ttft_le_{TTFT_GOAL_RATIO:g}x_idle": ratio is not None and ratio <= TTFT_GOAL_RATIO,
                "nothing_lost": not lost,
            },
        }

    @property
    def held(self) -> bool:
        """/healthz answered beside the flood, nothing lost, every socket cut with a 408."""
        s = self.summary()
        return (
            s["goals"][f"healthz_p99_le_{HEALTHZ_GOAL_S:g}s"]
            and s["goals"]["nothing_lost"]
            and all(b.status == 408 for b in self.slow)
        )


def slow_flood(app: App, body_timeout_s: float, probe_tokens: int) -> SlowFlood:
    """Idle /healthz and time to first token; then FLOOD_FACTOR x the ingress's ongoing limit in
    sockets that send headers and part of a body, and the same measured beside them, plus plain
    requests; then every socket's answer (a 408: cut to make room, or at the body deadline); then
    the idle time to first token again (its median over both sides is the flood's baseline)."""
    limit = int(stats(app.url)["ongoing_limit"])
    body = {"prompt": PROMPT, "max_tokens": probe_tokens}
    healthz_idle = [healthz_s(app.url, app.timeout_s) for _ in range(N_HEALTHZ)]
    idle = [first_token_s(app.url, body, app.timeout_s) for _ in range(N_TTFT)]
    t0 = time.monotonic()
    sockets = [_slow_body(app.url, body_timeout_s + 60) for _ in range(FLOOD_FACTOR * limit)]
    time.sleep(0.5)  # each has sent its headers and part of its body
    healthz_beside = [healthz_s(app.url, app.timeout_s) for _ in range(N_HEALTHZ)]
    beside = [first_token_s(app.url, body, app.timeout_s) for _ in range(N_TTFT)]
    plain = [complete(app.url, body, timeout_s=app.timeout_s) for _ in range(2)]
    with ThreadPoolExecutor(len(sockets)) as pool:  # each read as it comes: its time is its answer's
        answers = list(pool.map(lambda s: _answer(s, t0), sockets))
    idle += [first_token_s(app.url, body, app.timeout_s) for _ in range(N_TTFT)]  # idle again, after
    return SlowFlood(
        limit,
        healthz_idle,
        [t for t, _ in idle],
        answers,
        healthz_beside,
        [t for t, _ in beside],
        [o for _, o in idle + beside],
        plain,
    )
