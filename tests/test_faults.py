"""Serving that stays up, end to end (tiny models, real Ray, 127.0.0.1 only): a drafter replica
killed mid-generation, a TP rank killed mid-generation, SIGTERM to `fly-serve serve` with requests
in flight, and a schemathesis fuzz of the app's own OpenAPI schema.

Only processes this module started are killed: pids come from the replicas themselves (`pid()`,
`rank_pids()`) and are checked to descend from this test process (or its `fly-serve serve`).
Every client call has a timeout; a call that reaches it counts as hung. Each test prints what it
sent and how each request ended, and the time to recovery."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests
from serve_fixture import ROOT, free_port, start_serve, stop_serve

pytestmark = pytest.mark.serve

KV_BUDGET_TOKENS = 4096  # each KV cache, on every rank (3 requests of 600 tokens fit together)
APP = {"tiny": True, "tp_size": 2, "max_batch": 8, "defaults": {"max_tokens": 8}, "kv_budget_tokens": KV_BUDGET_TOKENS}
PROMPT = "def add(a, b):\n    return"
LONG_TOKENS = 200  # an in-flight request: still generating when the fault comes
CLIENT_TIMEOUT_S = 150.0  # a client waits this long for the next bytes; past it the call is hung
RECOVERY_TIMEOUT_S = 180.0
GRACE_S = 60.0  # `fly-serve serve --grace-s`
SHUTDOWN_S = 60.0  # Serve and Ray stopping, after the grace period
START_TIMEOUT_S = 300.0
FUZZ_EXAMPLES = 25  # per operation and generation mode
FUZZ_MAX_TOKENS = 8  # fuzzed bodies ask for at most this many tokens: the fuzz is about shapes


# ---- clients
@dataclass
class Outcome:
    kind: str  # "ok" (200, complete), "error" (a clean error answer), "dropped" (connection cut), "hung"
    started: float  # time.monotonic()
    ended: float
    detail: str = ""
    body: dict | None = None  # the response, or a stream's last chunk
    longest_pause_s: float = 0.0  # a stream: the longest wait between two events


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


def complete(url: str, body: dict, stream: bool = False, path: str = "/v1/completions") -> Outcome:
    """One request; never raises: how it ended is the outcome."""
    t0 = time.monotonic()
    try:
        with requests.post(
            f"{url}{path}", json={**body, "stream": stream}, stream=stream, timeout=CLIENT_TIMEOUT_S
        ) as r:
            if r.status_code != 200:
                return Outcome("error", t0, time.monotonic(), f"{r.status_code} {r.text[:300]}")
            if not stream:
                return Outcome("ok", t0, time.monotonic(), body=r.json())
            events, done, pause = parse_sse(r)
    except requests.Timeout as e:
        return Outcome("hung", t0, time.monotonic(), repr(e))
    except requests.ConnectionError as e:  # ChunkedEncodingError too: the connection was cut
        return Outcome("dropped", t0, time.monotonic(), repr(e))
    errors = [e for e in events if "error" in e]
    if errors:
        return Outcome("error", t0, time.monotonic(), json.dumps(errors[0])[:300], longest_pause_s=pause)
    if not done:
        return Outcome("dropped", t0, time.monotonic(), "the stream ended without [DONE]", longest_pause_s=pause)
    return Outcome("ok", t0, time.monotonic(), body=events[-1] if events else None, longest_pause_s=pause)


def finished_normally(o: Outcome) -> bool:
    """A whole answer: it ended by length or a stop, with tokens (a stream's last chunk too)."""
    choice = o.body["choices"][0]
    return choice["finish_reason"] in ("length", "stop") and o.body["usage"]["completion_tokens"] > 0


def tally(outcomes: list[Outcome]) -> dict:
    counts = {"sent": len(outcomes), "ok": 0, "error": 0, "dropped": 0, "hung": 0}
    for o in outcomes:
        counts[o.kind] += 1
    return counts


def report(title: str, **parts) -> None:
    print(f"\n[faults] {title}: " + "; ".join(f"{k}={v}" for k, v in parts.items()), flush=True)


def in_flight(url: str, body: dict, n_plain: int = 2, n_stream: int = 1):
    """Starts n_plain + n_stream long requests; returns the pool and their futures."""
    pool = ThreadPoolExecutor(n_plain + n_stream)
    futures = [pool.submit(complete, url, body, s) for s in [False] * n_plain + [True] * n_stream]
    return pool, futures


def wait_generating(url: str, n: int, timeout_s: float = 60.0) -> None:
    """Until n requests are running in the engine and a few rounds have passed."""
    deadline, first_rounds = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        stats = requests.get(f"{url}/v1/fly/stats", timeout=10).json()
        if stats["running"] >= n:
            first_rounds = stats["rounds"] if first_rounds is None else first_rounds
            if stats["rounds"] >= first_rounds + 3:
                return
        time.sleep(0.1)
    raise AssertionError(f"{n} requests never ran together: {stats}")


def wait_status(url: str, status: int, timeout_s: float) -> float | None:
    """When (time.monotonic()) /healthz first answers `status`; None if not within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == status:
                return time.monotonic()
        except requests.RequestException:
            pass
        time.sleep(0.1)
    return None


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
    """SIGKILL a Ray worker of this test's own Ray (never anything else)."""
    assert pid != os.getpid() and os.getpid() in ancestors(pid), f"pid {pid} is not a process this test started"
    os.kill(pid, signal.SIGKILL)


def handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name="fly")


def ask(call, timeout_s: float = 5.0):
    """A handle call's result, or None while the replica is away."""
    try:
        return call.result(timeout_s=timeout_s)
    except Exception:
        return None


# ---- c. graceful shutdown of `fly-serve serve` (first: it runs its own Ray, before the module's)
class ServeProcess:
    """`python -m fly_cli.main serve --tiny` in a session of its own, its output collected."""

    def __init__(self, port: int):
        self.lines: list[str] = []
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fly_cli.main", "serve", "--tiny", "--port", str(port), "--grace-s", str(GRACE_S)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
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

    def kill_group(self) -> None:
        """Only when a test failed: the process and the Ray it started."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def test_sigterm_lets_in_flight_requests_finish():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServeProcess(port)
    try:
        assert server.wait_for("fly-serve: ready", START_TIMEOUT_S), "\n".join(server.lines[-40:])
        body = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "fly": {"mode": "ar"}}
        pool, futures = in_flight(url, body, n_plain=1, n_stream=1)
        wait_generating(url, 2)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # once the ingress drains, /healthz says so and new requests are turned away
        draining = wait_status(url, 503, timeout_s=10)
        refused = complete(url, {"prompt": PROMPT, "max_tokens": 4})
        outcomes = [f.result() for f in futures]
        pool.shutdown()
        rc = server.proc.wait(timeout=GRACE_S + SHUTDOWN_S)
        exit_s = time.monotonic() - t_term
    finally:
        server.kill_group()
    report(
        "SIGTERM with 2 in flight (1 streaming)",
        requests=tally(outcomes),
        finished_s_after_term=[round(o.ended - t_term, 1) for o in outcomes],
        stream_longest_pause_s=round(outcomes[1].longest_pause_s, 1),
        healthz_503_s_after_term=None if draining is None else round(draining - t_term, 1),
        request_after_term=f"{refused.kind} {refused.detail[:80]}",
        exit_code=rc,
        exit_s_after_term=round(exit_s, 1),
        log=[line for line in server.lines if line.startswith("fly-serve:")],
    )
    assert [o.kind for o in outcomes] == ["ok", "ok"], [o.detail for o in outcomes]
    assert all(o.ended > t_term for o in outcomes), "a request finished before SIGTERM: nothing was in flight"
    assert all(finished_normally(o) for o in outcomes), [o.body for o in outcomes]
    assert draining is not None, "/healthz never said 503 while draining"
    assert refused.kind == "error" and refused.detail.startswith("503"), refused
    assert rc == 0
    assert exit_s < GRACE_S + SHUTDOWN_S


# ---- the module's app: tiny pair, target TP=2
@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


# ---- d. schemathesis on the app's own schema
def served_openapi(url: str) -> tuple[dict, list[str]]:
    """The app's own /openapi.json, and the POST routes whose request body it declares (the
    fuzz sends bodies only where the schema says what they are)."""
    doc = requests.get(f"{url}/openapi.json", timeout=30).json()
    declared = [path for path, ops in doc["paths"].items() if "requestBody" in ops.get("post", {})]
    return doc, declared


def small(case):
    """Fuzzed bodies ask for few tokens (each case is a real generation on 2 cores)."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and case.body[field] > FUZZ_MAX_TOKENS:
                case.body[field] = FUZZ_MAX_TOKENS
    return case


@dataclass
class Fuzzed:
    cases: int = 0
    statuses: dict | None = None  # status code -> count
    server_errors: list | None = None


def fuzz(op, mode, url: str, session: requests.Session) -> Fuzzed:
    """FUZZ_EXAMPLES cases of one operation in one generation mode against the live app."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    out = Fuzzed(0, {}, [])

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same cases every run
    )
    @given(case=op.as_strategy(generation_mode=mode).map(small))
    def run(case):
        out.cases += 1
        response = case.call(base_url=url, session=session, timeout=CLIENT_TIMEOUT_S)
        out.statuses[response.status_code] = out.statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except Exception:
            out.server_errors.append(f"{response.status_code} {case.body!r:.300} -> {response.text[:300]}")
            raise

    try:
        run()
    except Exception as e:  # a server error is in out.server_errors; anything else is the test's
        if not out.server_errors:
            raise AssertionError(f"{op.method.upper()} {op.path} ({mode.value}): {e!r}") from e
    return out


def test_schemathesis_finds_no_server_error(url):
    import schemathesis

    doc, declared = served_openapi(url)
    assert {"/v1/completions", "/v1/chat/completions"} <= set(declared), declared
    schema = schemathesis.openapi.from_dict(doc)
    session = requests.Session()
    results: dict[str, Fuzzed] = {}
    for op in (result.ok() for result in schema.include(method="POST").get_all_operations()):
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            results[f"{op.method.upper()} {op.path} ({mode.value})"] = fuzz(op, mode, url, session)
    report(
        "schemathesis",
        bodies_declared=declared,
        cases={name: r.cases for name, r in results.items()},
        statuses={name: r.statuses for name, r in results.items()},
        server_errors={name: r.server_errors for name, r in results.items() if r.server_errors} or "none",
    )
    assert len(results) == 4 and all(r.cases > 0 for r in results.values())
    assert not any(r.server_errors for r in results.values())


# ---- a. the drafter replica killed mid-generation
class DrafterWatch:
    """Polls the drafter deployment in the background: when a replica other than `old_pid`
    first reports model forwards (speculation with the model again)."""

    def __init__(self, old_pid: int):
        self.old_pid, self.drafter = old_pid, handle("FlyDrafter")
        self.new_pid, self.cache, self.back_at = None, None, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set() and self.back_at is None:
            pid = ask(self.drafter.pid.remote(), 2)
            if pid not in (None, self.old_pid):
                self.new_pid, self.cache = pid, ask(self.drafter.cache_report.remote(), 2)
                if self.cache and self.cache["forwards"] > 0:
                    self.back_at = time.monotonic()
            self.stop.wait(0.25)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_drafter_killed_mid_generation(url):
    old_pid = handle("FlyDrafter").pid.remote().result(timeout_s=30)
    # the tiny pair agrees on most drafts: small k keeps the requests in flight for many rounds
    body = {"prompt": PROMPT, "max_tokens": 3 * LONG_TOKENS, "fly": {"mode": "fly", "k": 2, "window": 1}}
    pool, futures = in_flight(url, body)
    wait_generating(url, len(futures))
    t_kill = time.monotonic()
    kill_ours(old_pid)
    watch = DrafterWatch(old_pid)
    outcomes = [f.result() for f in futures]
    pool.shutdown()
    # later requests: speculate with the (new) drafter again
    watch.thread.join(timeout=RECOVERY_TIMEOUT_S)
    watch.close()
    probe = {"prompt": PROMPT, "max_tokens": 8, "fly": {"mode": "fly", "k": 2, "window": 1}}
    cache_before = ask(watch.drafter.cache_report.remote(), 30)
    probes = [complete(url, probe) for _ in range(3)]
    cache_after = ask(watch.drafter.cache_report.remote(), 30)
    report(
        "drafter replica SIGKILLed with 3 in flight (1 streaming)",
        in_flight=tally(outcomes),
        in_flight_finished_s_after_kill=[round(o.ended - t_kill, 1) for o in outcomes],
        stream_longest_pause_s=round(outcomes[-1].longest_pause_s, 1),
        recovery_s=None if watch.back_at is None else round(watch.back_at - t_kill, 1),
        later_requests=tally(probes),
        later_drafted=[p.body["fly"]["drafted"] for p in probes if p.kind == "ok"],
        drafter_pid=f"{old_pid} -> {watch.new_pid}",
        new_drafter_cache=cache_after,
    )
    assert [o.kind for o in outcomes] == ["ok"] * 3, [o.detail for o in outcomes]
    assert all(o.ended > t_kill for o in outcomes), "a request finished before the kill"
    assert all(finished_normally(o) for o in outcomes), [o.body for o in outcomes]
    assert watch.back_at is not None, "no new drafter replica drafted"
    assert [p.kind for p in probes] == ["ok"] * 3 and all(p.body["fly"]["drafted"] > 0 for p in probes)
    assert cache_after["forwards"] > cache_before["forwards"]  # the later requests drafted with the model
    assert not alive(old_pid)


# ---- b. one TP rank killed mid-generation
def test_tp_rank_killed_mid_generation(url):
    from ray import serve

    target = handle("FlyTarget")
    old_replica = target.pid.remote().result(timeout_s=30)
    old_ranks = target.rank_pids.remote().result(timeout_s=30)
    assert len(old_ranks) == 2
    assert target.rank_kv_capacities.remote().result(timeout_s=30) == [KV_BUDGET_TOKENS] * 2
    body = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "fly": {"mode": "ar"}}
    pool, futures = in_flight(url, body)
    wait_generating(url, len(futures))
    t_kill = time.monotonic()
    kill_ours(old_ranks[1])
    outcomes = [f.result() for f in futures]
    pool.shutdown()

    probes, healthz, target_status, recovered_s = [], set(), set(), None
    probe = {"prompt": PROMPT, "max_tokens": 8, "fly": {"mode": "ar"}}
    while time.monotonic() - t_kill < RECOVERY_TIMEOUT_S:
        healthz.add(requests.get(f"{url}/healthz", timeout=10).status_code)
        target_status.add(str(serve.status().applications["fly"].deployments["FlyTarget"].status))
        probes.append(complete(url, probe))
        if probes[-1].kind == "ok":
            recovered_s = probes[-1].ended - t_kill
            break
        time.sleep(0.5)
    new_replica = ask(target.pid.remote(), 30)
    new_ranks = ask(target.rank_pids.remote(), 30)
    new_kv = ask(target.rank_kv_capacities.remote(), 30)
    report(
        "TP rank 1 SIGKILLed with 3 in flight (1 streaming)",
        in_flight=tally(outcomes),
        in_flight_ended_s_after_kill=[round(o.ended - t_kill, 1) for o in outcomes],
        stream_longest_pause_s=round(outcomes[-1].longest_pause_s, 1),
        in_flight_errors=sorted({o.detail[:160] for o in outcomes if o.kind != "ok"}),
        later_requests=tally(probes),
        recovery_s=None if recovered_s is None else round(recovered_s, 1),
        healthz_seen=sorted(healthz),
        target_status_seen=sorted(target_status),
        target_replica_pid=f"{old_replica} -> {new_replica}",
        rank_pids=f"{old_ranks} -> {new_ranks}",
        new_rank_kv_capacities=new_kv,
    )
    # the in-flight requests end, cleanly, well before the client would give up
    assert all(o.kind in ("ok", "error") for o in outcomes), [(o.kind, o.detail) for o in outcomes]
    assert all(o.ended - t_kill < CLIENT_TIMEOUT_S for o in outcomes)
    assert recovered_s is not None, f"no request succeeded after the kill: {[p.detail for p in probes[-3:]]}"
    # the group was rebuilt whole: a new replica with new ranks, and no old rank left behind
    assert new_replica not in (None, old_replica)
    assert new_ranks and not set(new_ranks) & set(old_ranks)
    assert not any(alive(p) for p in old_ranks)
    assert new_kv == [KV_BUDGET_TOKENS] * 2  # the rebuilt group has the profile's budget on every rank
    assert all(complete(url, probe).kind == "ok" for _ in range(3))


# ---- e. a hung rank (SIGSTOP): the round times out with a clear error, the group is rebuilt
HUNG_ROUND_TIMEOUT_S = 8.0


def test_hung_rank_times_out_and_the_group_is_rebuilt(url):
    from ray import serve

    from deployments.placement import tp_bundles
    from deployments.target_replica import TargetDeployment, TPGroupBroken
    from fly_serve.contracts import Drafts, Row

    target = TargetDeployment.options(
        name="HungTarget",
        placement_group_bundles=tp_bundles(2, {"num_cpus": 0.1}, 0.2),
        placement_group_strategy="STRICT_PACK",
    )
    app = target.bind("tiny:0", "fp32", 2, 2, None, {"num_cpus": 0.1}, round_timeout_s=HUNG_ROUND_TIMEOUT_S)
    h = serve.run(app, name="hung", route_prefix=None)
    rows, drafts = [Row("hung-a", [5, 17, 42, 99], k=2, entropy="topk")], Drafts([[4, 5]], [None])
    stopped = None
    try:
        h.verify.remote(rows, drafts).result(timeout_s=60)
        old_replica, old_ranks = h.pid.remote().result(timeout_s=30), h.rank_pids.remote().result(timeout_s=30)
        stopped = old_ranks[1]
        assert os.getpid() in ancestors(stopped)
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.monotonic()
        with pytest.raises(TPGroupBroken) as failed:
            h.verify.remote(rows, drafts).result(timeout_s=HUNG_ROUND_TIMEOUT_S + 60)
        failed_s = time.monotonic() - t_stop
        recovered_s, new_replica = None, None
        while time.monotonic() - t_stop < RECOVERY_TIMEOUT_S and recovered_s is None:
            new_replica = ask(h.pid.remote(), 10)
            if new_replica not in (None, old_replica) and ask(h.verify.remote(rows, drafts), 30) is not None:
                recovered_s = time.monotonic() - t_stop
            time.sleep(0.5)
        new_ranks = ask(h.rank_pids.remote(), 30)
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGCONT)  # the group kills it; this only matters if the test failed
        serve.delete("hung")
    report(
        "TP rank 1 SIGSTOPped (hung), one verify in flight",
        error_s=round(failed_s, 1),
        error=str(failed.value).splitlines()[-1][:200],
        recovery_s=None if recovered_s is None else round(recovered_s, 1),
        target_replica_pid=f"{old_replica} -> {new_replica}",
        rank_pids=f"{old_ranks} -> {new_ranks}",
    )
    assert failed_s < HUNG_ROUND_TIMEOUT_S + 10  # the round's timeout, or a failed ping before it
    assert recovered_s is not None, "the hung group was never replaced"
    assert new_ranks and not set(new_ranks) & set(old_ranks)
    assert not any(alive(p) for p in old_ranks)
