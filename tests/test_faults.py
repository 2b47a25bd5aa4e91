"""Serving that stays up, end to end (tiny models, real Ray, 127.0.0.1 only): a drafter replica
killed mid-generation, a TP rank killed mid-generation, SIGTERM to `fly-serve serve` with requests
in flight, and a schemathesis fuzz of the app's own OpenAPI schema.

Only processes this module started are killed: pids come from the replicas themselves (`pid()`,
the target's `report()`) and are checked to descend from this test process (or its `fly-serve serve`).
Every client call has a timeout; a call that reaches it counts as hung. Each test prints what it
sent and how each request ended, and the time to recovery."""

import os
import signal
import sys
import time

import pytest
import requests
from serve_fixture import ROOT, free_port, start_serve, stop_serve

sys.path.insert(0, str(ROOT / "loadtest"))  # the fault mechanics, shared with loadtest/fault_run.py
from faults import (  # noqa: E402
    CLIENT_TIMEOUT_S,
    DrafterWatch,
    ServeProcess,
    alive,
    ancestors,
    complete,
    finished_normally,
    fuzz_app,
    in_flight,
    kill_ours,
    report,
    tally,
    wait_generating,
    wait_status,
)

pytestmark = pytest.mark.serve

KV_BUDGET_TOKENS = 4096  # each KV cache, on every rank (3 requests of 600 tokens fit together)
APP = {"tiny": True, "tp_size": 2, "max_batch": 8, "defaults": {"max_tokens": 8}, "kv_budget_tokens": KV_BUDGET_TOKENS}
PROMPT = "def add(a, b):\n    return"
LONG_TOKENS = 200  # an in-flight request: still generating when the fault comes
RECOVERY_TIMEOUT_S = 180.0
GRACE_S = 60.0  # `fly-serve serve --grace-s`
SHUTDOWN_S = 60.0  # Serve and Ray stopping, after the grace period
START_TIMEOUT_S = 300.0


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
def test_sigterm_lets_in_flight_requests_finish():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServeProcess(port, tiny=True, grace_s=GRACE_S)
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
def test_schemathesis_finds_no_server_error(url):
    declared, results = fuzz_app(url)
    assert {"/v1/completions", "/v1/chat/completions"} <= set(declared), declared
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
def test_drafter_killed_mid_generation(url):
    old_pid = handle("FlyDrafter").pid.remote().result(timeout_s=30)
    # the tiny pair agrees on most drafts: small k keeps the requests in flight for many rounds
    body = {"prompt": PROMPT, "max_tokens": 3 * LONG_TOKENS, "fly": {"mode": "fly", "k": 2, "window": 1}}
    pool, futures = in_flight(url, body)
    wait_generating(url, len(futures))
    t_kill = time.monotonic()
    kill_ours(old_pid)
    drafter = handle("FlyDrafter")
    watch = DrafterWatch(old_pid, lambda: ask(drafter.pid.remote(), 2), lambda: ask(drafter.cache_report.remote(), 2))
    outcomes = [f.result() for f in futures]
    pool.shutdown()
    # later requests: speculate with the (new) drafter again
    watch.thread.join(timeout=RECOVERY_TIMEOUT_S)
    watch.close()
    probe = {"prompt": PROMPT, "max_tokens": 8, "fly": {"mode": "fly", "k": 2, "window": 1}}
    cache_before = ask(drafter.cache_report.remote(), 30)
    probes = [complete(url, probe) for _ in range(3)]
    cache_after = ask(drafter.cache_report.remote(), 30)
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
    before = target.report.remote().result(timeout_s=30)
    old_replica, old_ranks = before.pid, before.rank_pids
    assert len(old_ranks) == 2
    assert before.rank_kv_capacities == [KV_BUDGET_TOKENS] * 2
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
    after = ask(target.report.remote(), 30)
    new_replica, new_ranks, new_kv = (after.pid, after.rank_pids, after.rank_kv_capacities) if after else (None,) * 3
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
    # while the group was rebuilt, /healthz said so and new requests got a 503 to retry, never a 500
    assert 503 in healthz, healthz
    assert all(p.status == 503 for p in probes[:-1]), [(p.status, p.detail[:80]) for p in probes]
    assert requests.get(f"{url}/healthz", timeout=10).status_code == 200
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
    from fly_serve.config import EngineConfig
    from fly_serve.contracts import Drafts, Row

    target = TargetDeployment.options(
        name="HungTarget",
        placement_group_bundles=tp_bundles(2, {"num_cpus": 0.1}, 0.2),
        placement_group_strategy="STRICT_PACK",
    )
    config = EngineConfig(target="tiny:0", drafter=None, dtype="fp32", max_batch=2)
    app = target.bind(config, tp_size=2, worker_options={"num_cpus": 0.1}, rank_call_timeout_s=HUNG_ROUND_TIMEOUT_S)
    h = serve.run(app, name="hung", route_prefix=None)
    rows, drafts = [Row("hung-a", [5, 17, 42, 99], k=2, entropy="topk")], Drafts([[4, 5]], [None])
    stopped = None
    try:
        h.verify.remote(rows, drafts).result(timeout_s=60)
        before = h.report.remote().result(timeout_s=30)
        old_replica, old_ranks = before.pid, before.rank_pids
        stopped = old_ranks[1]
        assert os.getpid() in ancestors(stopped)
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.monotonic()
        with pytest.raises(TPGroupBroken) as failed:
            h.verify.remote(rows, drafts).result(timeout_s=HUNG_ROUND_TIMEOUT_S + 60)
        failed_s = time.monotonic() - t_stop
        recovered_s, new_replica = None, None
        while time.monotonic() - t_stop < RECOVERY_TIMEOUT_S and recovered_s is None:
            new_replica = getattr(ask(h.report.remote(), 10), "pid", None)
            if new_replica not in (None, old_replica) and ask(h.verify.remote(rows, drafts), 30) is not None:
                recovered_s = time.monotonic() - t_stop
            time.sleep(0.5)
        new_ranks = getattr(ask(h.report.remote(), 30), "rank_pids", None)
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


def test_soak_classifies_the_openai_clients_transport_errors():
    """soak.py reads the openai client's transport errors by class name: httpx (openai 1.x-2.x)
    and httpx2 (3.x) name them alike, and neither is this project's dependency by name."""
    import importlib
    import importlib.util

    import soak

    transports = [importlib.import_module(m) for m in ("httpx", "httpx2") if importlib.util.find_spec(m)]
    assert transports  # openai depends on one of them
    for t in transports:
        assert soak.transport_error(t.ReadTimeout("slow"), "TimeoutException")
        assert soak.transport_error(t.ConnectError("refused"), "HTTPError")
        assert not soak.transport_error(t.ConnectError("refused"), "TimeoutException")
    assert not soak.transport_error(ValueError("x"), "HTTPError")
