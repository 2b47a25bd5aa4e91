"""Serving that stays up, end to end (tiny models, real Ray, 127.0.0.1 only): the fault scenarios
of loadtest (a TP rank killed mid-generation, SIGTERM to `fly-serve serve` with requests in
flight, a schemathesis fuzz of the app's own OpenAPI schema) run against a live app and their
results are asserted on here; the drafter replica killed mid-generation through the fault run
itself (`python -m loadtest.fault_run`, on the profile with a drafter replica, and a failure on one
without); a hung rank (SIGSTOP) on a deployment of its own.

Only processes this test process started are killed: pids come from the process tree under it
(loadtest.procs.replica_pids) and loadtest.procs.kill_ours refuses any other. Every client call
has a timeout; a call that reaches it counts as hung. Each test prints what it sent and how each
request ended, and the time to recovery."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
from serve_fixture import ROOT, start_serve, stop_serve

from loadtest.client import CLIENT_TIMEOUT_S
from loadtest.fault_run import table
from loadtest.fuzz import fuzz_app
from loadtest.procs import alive, app_processes, kill_ours, replica_pids
from loadtest.scenarios import App, sigterm_drain, tp_rank_kill
from loadtest.server import ServeProcess
from loadtest.waits import until

pytestmark = pytest.mark.serve

KV_BUDGET_TOKENS = 4096  # each KV cache, on every rank (3 requests of 600 tokens fit together)
APP = {"tiny": True, "tp_size": 2, "max_batch": 8, "defaults": {"max_tokens": 8}, "kv_budget_tokens": KV_BUDGET_TOKENS}
LONG_TOKENS = 200  # an in-flight request: still generating when the fault comes
# The SIGTERM test's requests run alone on a one-replica tiny app, about 1.5 ms a round: 200 tokens
# could end before the waiter saw both run together (a CI failure). 600 keep them in flight 3x
# longer (1,000 never ran: the tiny model's context is 1,024 positions).
DRAIN_TOKENS = 600
PROBE_TOKENS = 8
RECOVERY_TIMEOUT_S = 180.0
GRACE_S = 60.0  # `fly-serve serve --grace-s`
SHUTDOWN_S = 60.0  # Serve and Ray stopping, after the grace period
START_TIMEOUT_S = 300.0


def report(title: str, summary: dict) -> None:
    print(f"\n[faults] {title}: {json.dumps(summary, default=str)}", flush=True)


def ask(call, timeout_s: float = 5.0):
    """A handle call's result, or None while the replica is away."""
    try:
        return call.result(timeout_s=timeout_s)
    except Exception:
        return None


# ---- graceful shutdown of `fly-serve serve` (first: it runs its own Ray, before the module's)
def test_sigterm_lets_in_flight_requests_finish():
    server = ServeProcess(tiny=True, grace_s=GRACE_S)
    try:
        assert server.wait_for("fly-serve: ready", START_TIMEOUT_S), "\n".join(server.lines[-40:])
        # Serve's own replicas run at the server's priority, not Ray's default nice 15 for workers
        # (launch.py); the app's computing replicas ahead of them at serving_nice (-10) where allowed
        procs = app_processes(server.proc.pid)
        computing = [pid for pid, name in procs.items() if name.startswith("ServeReplica:fly:")]
        serve_own = [pid for pid, name in procs.items() if name.startswith(("ServeController", "ProxyActor"))]
        allowed = os.geteuid() == 0  # root may lower a nice (CAP_SYS_NICE too; not tested here)
        assert computing and {psutil.Process(pid).nice() for pid in computing} == {-10 if allowed else os.nice(0)}
        assert serve_own and {psutil.Process(pid).nice() for pid in serve_own} == {os.nice(0)}
        d = sigterm_drain(server, DRAIN_TOKENS, GRACE_S + SHUTDOWN_S)
    finally:
        server.kill_group()
    report("SIGTERM with 2 in flight (1 streaming)", d.summary())
    assert [o.kind for o in d.in_flight] == ["ok", "ok"], [o.detail for o in d.in_flight]
    assert all(o.ended > d.t_term for o in d.in_flight), "a request finished before SIGTERM: nothing was in flight"
    assert all(o.finished_normally for o in d.in_flight), [o.body for o in d.in_flight]
    assert d.healthz_503_s is not None, "/healthz never said 503 while draining"
    assert d.refused.kind == "error" and d.refused.status == 503, d.refused
    assert d.exit_code == 0
    assert d.exit_s < GRACE_S + SHUTDOWN_S


# ---- the fault run's drafter kill (before the module's Ray too: each run starts its own server)
FAULT_RUN_S = START_TIMEOUT_S + 2 * RECOVERY_TIMEOUT_S + 2 * CLIENT_TIMEOUT_S  # every wait it may make
ANSWERED = {"sent": 3, "answered": 3, "errored": 0, "dropped": 0, "hung": 0}


def fault_run(*argv: str) -> tuple[int, dict, str]:
    """`python -m loadtest.fault_run --tiny --only drafter_kill ...` as a child of this process:
    its exit code, its JSON summary (stdout's first part) and its log. Past its time it gets a
    SIGTERM, which stops the server it started, and the test fails."""
    limits = ["--start-timeout-s", str(START_TIMEOUT_S), "--recovery-timeout-s", str(RECOVERY_TIMEOUT_S)]
    argv = ("--tiny", "--only", "drafter_kill", *limits, "--grace-s", "10", *argv)
    run = subprocess.Popen(
        [sys.executable, "-m", "loadtest.fault_run", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, log = run.communicate(timeout=FAULT_RUN_S)
    except subprocess.TimeoutExpired:
        run.terminate()
        out, log = run.communicate(timeout=GRACE_S + SHUTDOWN_S)
        pytest.fail(f"the fault run took over {FAULT_RUN_S:g} s:\n{log[-3000:]}")
    assert out.lstrip().startswith("{"), f"exit {run.returncode}, no summary:\n{log[-3000:]}"
    summary, _ = json.JSONDecoder().raw_decode(out.lstrip())
    return run.returncode, summary, log


def test_fault_run_kills_the_drafter_replica_of_its_replica_profile():
    # the tiny pair agrees on most drafts: the scenario's small k and 600 tokens keep 3 requests in flight
    rc, summary, log = fault_run("--inflight-tokens", "600", "--max-tokens", str(PROBE_TOKENS))
    d = summary["drafter_kill"]
    report("fault run: drafter replica SIGKILLed with 3 in flight (1 streaming)", d)
    assert rc == 0 and summary["failed"] == [], (d, log[-3000:])
    # the run's default replica profile, said in its summary, its log and its table
    assert d["profile"] == "deployments/profiles/cpu-tp2.yaml"
    assert [s["profile"] for s in summary["servers"]] == ["deployments/profiles/cpu-tp2.yaml"]
    assert "on deployments/profiles/cpu-tp2.yaml" in log
    assert all(row.endswith("| deployments/profiles/cpu-tp2.yaml |") for row in table(summary).splitlines()[2:])
    assert d["in_flight"] == ANSWERED and d["in_flight_finished_normally"] == 3, d["in_flight_errors"]
    assert d["in_flight_ended_before_kill"] == 0, "a request finished before the kill"
    assert d["recovery_s"] is not None, "no new drafter replica drafted"
    old_pid, new_pid = d["drafter_pid"].split(" -> ")
    assert new_pid not in ("None", old_pid) and not d["old_pid_alive"]
    assert d["later_requests"] == ANSWERED and all(n > 0 for n in d["later_drafted"]), d["later_errors"]
    assert d["drafter_forwards_during_later"] > 0  # the later requests drafted with the new replica's model


def test_fault_run_fails_where_its_profile_has_no_drafter_replica():
    # cpu-default runs the drafter inside the ingress process: nothing to kill is a failure, not a skip
    rc, summary, log = fault_run("--replica-profile", "cpu-default")
    d = summary["drafter_kill"]
    report("fault run: drafter kill on a profile without a drafter replica", d)
    assert rc == 1 and summary["failed"] == ["drafter_kill"], log[-3000:]
    assert d["profile"] == "deployments/profiles/cpu-default.yaml"
    assert "expected one drafter replica, found pids []" in d["failed"]  # the app was up: it looked
    assert any(row.startswith("| drafter_kill |") and "FAILED" in row for row in table(summary).splitlines())


# ---- the module's app: tiny pair, target TP=2, its Ray under this process
@pytest.fixture(scope="module")
def app():
    url = start_serve(APP)
    yield App(url, os.getpid(), recovery_timeout_s=RECOVERY_TIMEOUT_S)
    stop_serve()


def handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name="fly")


# ---- schemathesis on the app's own schema: fresh cases every run
def test_schemathesis_finds_no_server_error(app):
    run = fuzz_app(app.url)
    report("schemathesis", run.summary())
    assert {"/v1/completions", "/v1/chat/completions"} <= set(run.declared), run.declared
    assert len(run.routes) == 4 and all(r.cases > 0 for r in run.routes)
    assert not run.server_errors, f"seed {run.seed}: {run.server_errors}"
    assert run.pinned and not run.pinned_wrong, run.pinned  # the hostile bodies of issue 47: each a 400


# ---- one TP rank killed mid-generation
def test_tp_rank_killed_mid_generation(app):
    target = handle("FlyTarget")
    assert target.report.remote().result(timeout_s=30).rank_kv_capacities == [KV_BUDGET_TOKENS] * 2
    r = tp_rank_kill(app, LONG_TOKENS, PROBE_TOKENS)
    after = ask(target.report.remote(), 30)
    new_kv = after.rank_kv_capacities if after else None
    report("TP rank SIGKILLed with 3 in flight (1 streaming)", r.summary() | {"new_rank_kv_capacities": new_kv})
    assert len(r.old_ranks) == 2
    # the in-flight requests end, cleanly, well before the client would give up
    assert all(o.kind in ("ok", "error") for o in r.in_flight), [(o.kind, o.detail) for o in r.in_flight]
    assert all(o.ended - r.t_kill < CLIENT_TIMEOUT_S for o in r.in_flight)
    assert r.recovery_s is not None, f"no request succeeded after the kill: {[p.detail for p in r.until_success[-3:]]}"
    # while the group was rebuilt, /healthz said so and new requests got a 503 to retry, never a 500
    assert r.healthz_first(503) is not None, r.healthz_changes
    assert all(p.status == 503 for p in r.until_success[:-1]), [(p.status, p.detail[:80]) for p in r.until_success]
    assert requests.get(f"{app.url}/healthz", timeout=10).status_code == 200
    # the group was rebuilt whole: a new replica with new ranks, and no old rank left behind
    assert r.new_replica and r.new_replica != r.old_replica
    # the surviving old rank dies with its replica, which Serve stops on its own time
    assert until(lambda: not any(alive(p) for p in r.old_ranks) or None, 60), [p for p in r.old_ranks if alive(p)]
    new_ranks = replica_pids(app.root_pid, "TPWorker")
    assert len(new_ranks) == 2 and not set(new_ranks) & set(r.old_ranks), (r.old_ranks, new_ranks)
    assert new_kv == [KV_BUDGET_TOKENS] * 2  # the rebuilt group has the profile's budget on every rank
    assert [o.kind for o in r.later] == ["ok"] * 3


# ---- a hung rank (SIGSTOP): the round times out with a clear error, the group is rebuilt
HUNG_ROUND_TIMEOUT_S = 8.0


def test_hung_rank_times_out_and_the_group_is_rebuilt(app):
    from ray import serve

    from deployments.parts.target_replica import TargetDeployment, TPGroupBroken
    from deployments.profiles.placement import tp_bundles
    from fly_serve.config import EngineConfig
    from fly_serve.contracts import Drafts, Row

    target = TargetDeployment.options(
        name="HungTarget",
        placement_group_bundles=tp_bundles(2, {"num_cpus": 0.1}, 0.2),
        placement_group_strategy="STRICT_PACK",
    )
    config = EngineConfig(target="tiny:0", drafter=None, dtype="fp32", max_batch=2)
    bound = target.bind(config, tp_size=2, worker_options={"num_cpus": 0.1}, rank_call_timeout_s=HUNG_ROUND_TIMEOUT_S)
    others = set(replica_pids(app.root_pid, "TPWorker"))  # the module app's ranks
    ranks = lambda: sorted(set(replica_pids(app.root_pid, "TPWorker")) - others)
    h = serve.run(bound, name="hung", route_prefix=None)
    rows, drafts = [Row("hung-a", [5, 17, 42, 99], k=2, entropy="topk")], Drafts([[4, 5]], [None])
    stopped = None
    try:
        h.verify.remote(rows, drafts).result(timeout_s=60)
        old_replica, old_ranks = replica_pids(app.root_pid, "HungTarget"), ranks()
        assert len(old_replica) == 1 and len(old_ranks) == 2, (old_replica, old_ranks)
        stopped = old_ranks[1]
        kill_ours(stopped, signal.SIGSTOP)
        t_stop = time.monotonic()
        with pytest.raises(TPGroupBroken) as failed:
            h.verify.remote(rows, drafts).result(timeout_s=HUNG_ROUND_TIMEOUT_S + 60)
        failed_s = time.monotonic() - t_stop

        def rebuilt():
            new = replica_pids(app.root_pid, "HungTarget")
            if new and new != old_replica and ask(h.verify.remote(rows, drafts), 30) is not None:
                return time.monotonic() - t_stop
            return None

        recovered_s = until(rebuilt, RECOVERY_TIMEOUT_S)
        new_replica, new_ranks = replica_pids(app.root_pid, "HungTarget"), ranks()
    finally:
        if stopped is not None and alive(stopped):
            kill_ours(stopped, signal.SIGCONT)  # the group kills it; this only matters if the test failed
        serve.delete("hung")
    report(
        "TP rank 1 SIGSTOPped (hung), one verify in flight",
        {
            "error_s": round(failed_s, 1),
            "error": str(failed.value).splitlines()[-1][:200],
            "recovery_s": None if recovered_s is None else round(recovered_s, 1),
            "target_replica_pid": f"{old_replica} -> {new_replica}",
            "rank_pids": f"{old_ranks} -> {new_ranks}",
        },
    )
    assert failed_s < HUNG_ROUND_TIMEOUT_S + 10  # the round's timeout, or a failed ping before it
    assert recovered_s is not None, "the hung group was never replaced"
    new_ranks = [p for p in new_ranks if p not in old_ranks]
    assert len(new_ranks) == 2
    assert not any(alive(p) for p in old_ranks)
