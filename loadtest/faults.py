"""Mechanics of fault runs against a live app (tests/test_faults.py, loadtest/fault_run.py): clients
whose every call has a timeout and ends in an Outcome, a runner for requests in flight, the tally,
waits on /healthz and the engine's stats, the app's processes and a SIGKILL that only reaches
processes this process started, `fly-serve serve` as a child process, a watch for a new drafter
replica that drafts, and a schemathesis fuzz of the app's own OpenAPI schema.

Nothing here imports the tests (layers point down: tests and loadtest import this).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import requests
from soak import app_processes

ROOT = Path(__file__).resolve().parent.parent
CLIENT_TIMEOUT_S = 150.0  # a client waits this long for the next bytes; past it the call is hung
FUZZ_EXAMPLES = 25  # per operation and generation mode
FUZZ_MAX_TOKENS = 8  # fuzzed bodies ask for at most this many tokens: the fuzz is about shapes


# ---- clients
@dataclass
class Outcome:
    kind: str  # "ok" (200, complete), "error" (a clean error answer), "dropped" (connection cut), "hung"
    started: float  # time.monotonic()
    ended: float
    detail: str = ""
    body: dict | None = None  # the response, a stream's last chunk, or an error answer's JSON body
    longest_pause_s: float = 0.0  # a stream: the longest wait between two events
    status: int | None = None  # the HTTP status, when one came


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
                return Outcome("error", t0, end, detail, _json_or_none(r), status=r.status_code)
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


def finished_normally(o: Outcome) -> bool:
    """A whole answer: it ended by length or a stop, with tokens (a stream's last chunk too)."""
    choice = o.body["choices"][0]
    return choice["finish_reason"] in ("length", "stop") and o.body["usage"]["completion_tokens"] > 0


TALLY_NAMES = {"ok": "answered", "error": "errored", "dropped": "dropped", "hung": "hung"}


def tally(outcomes: list[Outcome]) -> dict:
    """sent / answered / errored (a clean error) / dropped (connection cut) / hung."""
    counts = {"sent": len(outcomes)} | {name: 0 for name in TALLY_NAMES.values()}
    for o in outcomes:
        counts[TALLY_NAMES[o.kind]] += 1
    return counts


def report(title: str, **parts) -> None:
    print(f"\n[faults] {title}: " + "; ".join(f"{k}={v}" for k, v in parts.items()), flush=True)


def in_flight(
    url: str, body: dict, n_plain: int = 2, n_stream: int = 1, timeout_s: float = CLIENT_TIMEOUT_S
) -> tuple[ThreadPoolExecutor, list[Future]]:
    """Starts n_plain + n_stream requests (plain first); returns the pool and their futures."""
    pool = ThreadPoolExecutor(n_plain + n_stream)
    futures = [pool.submit(complete, url, body, s, timeout_s=timeout_s) for s in [False] * n_plain + [True] * n_stream]
    return pool, futures


def gather(pool: ThreadPoolExecutor, futures: list[Future], timeout_s: float) -> list[Outcome]:
    """Every future's outcome within timeout_s; one still running then counts as hung (its thread is
    left behind: a client that never returns must not stop the run)."""
    t0 = time.monotonic()
    wait_futures(futures, timeout=timeout_s)
    now = time.monotonic()
    out = [f.result() if f.done() else Outcome("hung", t0, now, f"no outcome within {timeout_s:g} s") for f in futures]
    pool.shutdown(wait=False, cancel_futures=True)
    return out


def stats(url: str, timeout_s: float = 10.0) -> dict:
    return requests.get(f"{url}/v1/fly/stats", timeout=timeout_s).json()


def wait_generating(url: str, n: int, timeout_s: float = 60.0, rounds: int = 3) -> None:
    """Until n requests are running in the engine and `rounds` rounds have passed since."""
    deadline, first_rounds, s = time.monotonic() + timeout_s, None, None
    while time.monotonic() < deadline:
        s = stats(url)
        if s["running"] >= n:
            first_rounds = s["rounds"] if first_rounds is None else first_rounds
            if s["rounds"] >= first_rounds + rounds:
                return
        time.sleep(0.1)
    raise AssertionError(f"{n} requests never ran together: {s}")


def healthz(url: str, timeout_s: float = 5.0) -> int | None:
    """/healthz's status; None when it did not answer."""
    try:
        return requests.get(f"{url}/healthz", timeout=timeout_s).status_code
    except requests.RequestException:
        return None


def wait_status(url: str, status: int, timeout_s: float) -> float | None:
    """When (time.monotonic()) /healthz first answers `status`; None if not within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if healthz(url) == status:
            return time.monotonic()
        time.sleep(0.1)
    return None


class HealthWatch:
    """Polls /healthz in the background from its start: each change of status and when it came
    (None: no answer), so a run can say when /healthz went 503 and when it came back."""

    def __init__(self, url: str, poll_s: float = 0.2):
        self.url, self.poll_s = url, poll_s
        self.t0 = time.monotonic()
        self.changes: list[tuple[float, int | None]] = []  # (seconds since start, status)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            status = healthz(self.url, timeout_s=2.0)
            if not self.changes or self.changes[-1][1] != status:
                self.changes.append((time.monotonic() - self.t0, status))
            self.stop.wait(self.poll_s)

    def first(self, status: int | None, after_s: float = 0.0) -> float | None:
        """Seconds from the start until /healthz first answered `status` (at or after after_s)."""
        return next((round(t, 1) for t, s in self.changes if s == status and t >= after_s), None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


# ---- processes
def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4, ppid (the name may hold spaces)
        chain.append(pid)
    return chain


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_ours(pid: int) -> None:
    """SIGKILL a process this process started, directly or through its Ray (never anything else)."""
    if pid == os.getpid() or os.getpid() not in ancestors(pid):  # a guard that python -O keeps
        raise PermissionError(f"pid {pid} is not a process this run started")
    os.kill(pid, signal.SIGKILL)


def actor_pids(root_pid: int, actor: str) -> list[int]:
    """Live Ray workers under root_pid whose actor class is `actor` ("TPWorker") or a Serve
    replica of the deployment `actor` ("FlyDrafter": Serve titles it ServeReplica:<app>:FlyDrafter)."""
    names = app_processes(root_pid)
    return sorted(pid for pid, name in names.items() if (name == actor or name.endswith(f":{actor}")) and alive(pid))


# ---- `fly-serve serve` as a child
class ServeProcess:
    """`python -m fly_cli.main serve ...` in a session of its own, its output collected; 127.0.0.1
    only. FLY_API_KEY is left out of its environment: the run's clients send no key."""

    def __init__(
        self,
        port: int,
        *,
        tiny: bool = False,
        config: str | None = None,
        grace_s: float | None = None,
        num_cpus: int | None = None,
    ):
        self.lines: list[str] = []
        args = ["--host", "127.0.0.1", "--port", str(port)]
        args += ["--tiny"] if tiny else []
        args += ["--config", config] if config else []
        args += ["--grace-s", str(grace_s)] if grace_s is not None else []
        args += ["--num-cpus", str(num_cpus)] if num_cpus is not None else []
        env = {k: v for k, v in os.environ.items() if k != "FLY_API_KEY"} | {"RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fly_cli.main", "serve", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its Ray lives in this process group: kill_group reaches all of it
        )
        self.url = f"http://127.0.0.1:{port}"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.5)
        return any(text in line for line in self.lines)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (a graceful stop), then the whole group if it is not gone within timeout_s;
        returns the exit status of the graceful stop (None: it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        rc = self.proc.poll()
        self.kill_group()
        return rc

    def kill_group(self) -> None:
        """The process and the Ray it started (its process group), whatever state they are in."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.proc.wait(timeout=30)


# ---- a new drafter replica that drafts
class DrafterWatch:
    """Polls in the background: when a drafter replica other than `old_pid` first reports model
    forwards (speculation with the model again). current_pid and cache_report ask the drafter
    deployment (a Serve handle, or the app's processes and /v1/fly/stats) and return None while
    it does not answer."""

    def __init__(
        self,
        old_pid: int,
        current_pid: Callable[[], int | None],
        cache_report: Callable[[], dict | None],
        poll_s: float = 0.25,
    ):
        self.old_pid, self.current_pid, self.cache_report, self.poll_s = old_pid, current_pid, cache_report, poll_s
        self.new_pid, self.cache, self.back_at = None, None, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set() and self.back_at is None:
            pid = self.current_pid()
            if pid not in (None, self.old_pid):
                self.new_pid, self.cache = pid, self.cache_report()
                if self.cache and self.cache["forwards"] > 0:
                    self.back_at = time.monotonic()
            self.stop.wait(self.poll_s)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


# ---- schemathesis on the app's own schema
def served_openapi(url: str) -> tuple[dict, list[str]]:
    """The app's own /openapi.json, and the POST routes whose request body it declares (the
    fuzz sends bodies only where the schema says what they are)."""
    doc = requests.get(f"{url}/openapi.json", timeout=30).json()
    declared = [path for path, ops in doc["paths"].items() if "requestBody" in ops.get("post", {})]
    return doc, declared


def small(case, max_tokens: int = FUZZ_MAX_TOKENS):
    """Fuzzed bodies ask for few tokens (each case is a real generation)."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and case.body[name] > max_tokens:
                case.body[name] = max_tokens
    return case


@dataclass
class Fuzzed:
    cases: int = 0
    statuses: dict = field(default_factory=dict)  # status code -> count
    server_errors: list = field(default_factory=list)


def fuzz(
    op,
    mode,
    url: str,
    session: requests.Session,
    examples: int = FUZZ_EXAMPLES,
    max_tokens: int = FUZZ_MAX_TOKENS,
    timeout_s: float = CLIENT_TIMEOUT_S,
) -> Fuzzed:
    """`examples` cases of one operation in one generation mode against the live app; the same
    cases every run. A 5xx is recorded (and ends this operation's run); anything else raises."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    out = Fuzzed()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same cases every run
    )
    @given(case=op.as_strategy(generation_mode=mode).map(lambda case: small(case, max_tokens)))
    def run(case):
        out.cases += 1
        response = case.call(base_url=url, session=session, timeout=timeout_s)
        out.statuses[response.status_code] = out.statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception:
            out.server_errors.append(f"{response.status_code} {case.body!r:.300} -> {response.text[:300]}")
            raise

    try:
        run()
    except Exception as e:  # a server error is in out.server_errors; anything else is the caller's
        if not out.server_errors:
            raise AssertionError(f"{op.method.upper()} {op.path} ({mode.value}): {e!r}") from e
    return out


def fuzz_app(url: str, examples: int = FUZZ_EXAMPLES, **kw) -> tuple[list[str], dict[str, Fuzzed]]:
    """Every POST operation with a declared body, positive and negative cases: the declared
    routes and one Fuzzed per "METHOD path (mode)"."""
    import schemathesis

    doc, declared = served_openapi(url)
    schema = schemathesis.openapi.from_dict(doc)
    session = requests.Session()
    results: dict[str, Fuzzed] = {}
    for op in (result.ok() for result in schema.include(method="POST").get_all_operations()):
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            results[f"{op.method.upper()} {op.path} ({mode.value})"] = fuzz(op, mode, url, session, examples, **kw)
    return declared, results
