"""loadtest's mechanics without a live app: the tally, the one wait loop, the kill guard, the fault
run's table, and soak.py's reading of the openai client's transport errors."""

import os
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from loadtest.client import Outcome, Tally, failures
from loadtest.fault_run import parse, plan, table
from loadtest.procs import alive, ancestors, kill_ours, replica_pids
from loadtest.waits import until


def test_tally_counts_each_kind_of_ending():
    kinds = ["ok", "ok", "error", "dropped", "hung"]
    assert asdict(Tally.of([Outcome(k, 0.0, 1.0) for k in kinds])) == dict(
        sent=5, answered=2, errored=1, dropped=1, hung=1
    )


def test_failures_group_errors_without_their_request_ids():
    def err(rid: str) -> Outcome:
        body = {"error": {"type": "server_error", "code": "target_unavailable", "message": f"failed; request id {rid}"}}
        return Outcome("error", 0.0, 1.0, body=body, status=503)

    got = failures([err("a1"), err("b2"), Outcome("ok", 0.0, 1.0), Outcome("hung", 0.0, 1.0, "timeout")])
    assert got == {"503 server_error/target_unavailable: failed; request id <id>": 2, "hung: timeout": 1}


def test_until_returns_the_first_answer_and_gives_up_at_its_deadline():
    calls = []

    def third_time():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the app is restarting")  # counts as not yet
        return "up" if len(calls) == 3 else None

    assert until(third_time, timeout_s=5, poll_s=0.01) == "up" and len(calls) == 3
    t0 = time.monotonic()
    assert until(lambda: None, timeout_s=0.2, poll_s=0.05) is None
    assert 0.2 <= time.monotonic() - t0 < 2
    assert until(lambda: 0, timeout_s=5) == 0  # a falsy answer is still an answer


def test_kill_ours_reaches_a_child_and_refuses_anything_else():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert os.getpid() in ancestors(child.pid) and alive(child.pid)
        kill_ours(child.pid)
        child.wait(timeout=10)
        assert not alive(child.pid)
    finally:
        child.kill()
    with pytest.raises(PermissionError):
        kill_ours(os.getppid())  # this process's parent: not ours
    with pytest.raises(PermissionError):
        kill_ours(os.getpid())
    assert replica_pids(os.getpid(), "FlyDrafter") == []  # no Ray under this process


def test_fault_run_kills_on_the_replica_profile_and_runs_the_rest_on_the_default():
    """The drafter and the TP rank are killed on a profile that has them (cpu-tp2: a FlyDrafter
    replica and a TP group); overload, hostile input, fuzz and soak run on the app as `fly-serve serve`
    starts it (the slow bodies' flood too)."""
    profiles = lambda argv: [(path.name, names) for path, names in plan(parse(argv))]
    assert profiles([]) == [
        ("cpu-tp2.yaml", ["drafter_kill", "tp_rank_kill"]),
        ("cpu-default.yaml", ["overload", "hostile", "slow_flood", "schemathesis"]),
    ]
    assert profiles(["--soak", "10", "--only", "drafter_kill", "soak"]) == [
        ("cpu-tp2.yaml", ["drafter_kill"]),
        ("cpu-default.yaml", ["soak"]),
    ]
    # one profile for both: one server runs every scenario
    assert profiles(["--profile", "cpu-tp2"]) == [
        ("cpu-tp2.yaml", ["drafter_kill", "tp_rank_kill", "overload", "hostile", "slow_flood", "schemathesis"])
    ]


def test_fault_run_table_has_a_row_per_fault_and_says_what_failed():
    tally = dict(sent=3, answered=3, errored=0, dropped=0, hung=0)
    summary = {
        "drafter_kill": {
            "profile": "deployments/profiles/cpu-tp2.yaml",
            "in_flight": tally,
            "recovery_s": 14.8,
            "drafter_pid": "1 -> 2",
            "later_requests": tally,
            "later_drafted": [5, 6, 7],
        },
        "tp_rank_kill": {
            "profile": "deployments/profiles/cpu-default.yaml",
            "failed": "ScenarioError('expected TP ranks (tp_size > 1), found pids []')",
        },
        "slow_flood": {
            "profile": "deployments/profiles/cpu-default.yaml",
            "ongoing_limit": 56,
            "slow_sockets": 168,
            "slow_statuses": ["408 request_timeout"],
            "slow_answered_s_min_max": [0.4, 20.1],
            "healthz_p99_idle_s": 0.01,
            "healthz_p99_beside_s": 0.02,
            "ttft_idle_median_s": 0.1,
            "ttft_beside_s": [0.1, 0.12, 0.11],
            "ttft_ratio": 1.2,
            "goals": {"healthz_p99_le_2s": True, "ttft_le_2x_idle": True, "nothing_lost": True},
        },
        "schemathesis": {
            "profile": "deployments/profiles/cpu-default.yaml",
            "seed": 7,
            "cases_per_route": {"POST /v1/completions": 1000},
            "statuses": {
                "POST /v1/completions (positive)": {"200": 400},
                "POST /v1/completions (negative)": {"400": 600},
            },
        },
    }
    rows = table(summary).splitlines()
    assert rows[0].startswith("| fault |") and rows[1].startswith("|---|")
    assert rows[0].endswith("| profile |") and len(rows[1].split("|")) == len(rows[0].split("|"))
    assert any("drafting again after 14.8 s" in r and r.endswith("| deployments/profiles/cpu-tp2.yaml |") for r in rows)
    assert any(r.startswith("| schemathesis | 1000 | 400 | 600 |") and "seed 7" in r and "5xx: 0" in r for r in rows)
    flood = [r for r in rows if r.startswith("| slow bodies, 168 sockets (3x Serve limit 56) |")]
    assert len(flood) == 1 and "/healthz p99 0.02 s" in flood[0] and "(1.2x)" in flood[0]
    failed = [r for r in rows if r.startswith("| tp_rank_kill |")]
    assert len(failed) == 1 and "FAILED: ScenarioError('expected TP ranks" in failed[0]
    assert failed[0].endswith("| deployments/profiles/cpu-default.yaml |")


def test_soak_classifies_the_openai_clients_transport_errors():
    """soak.py reads the openai client's transport errors by class name: httpx (openai 1.x-2.x)
    and httpx2 (3.x) name them alike, and neither is this project's dependency by name."""
    import importlib
    import importlib.util

    from loadtest import soak

    transports = [importlib.import_module(m) for m in ("httpx", "httpx2") if importlib.util.find_spec(m)]
    assert transports  # openai depends on one of them
    for t in transports:
        assert soak.transport_error(t.ReadTimeout("slow"), "TimeoutException")
        assert soak.transport_error(t.ConnectError("refused"), "HTTPError")
        assert not soak.transport_error(t.ConnectError("refused"), "TimeoutException")
    assert not soak.transport_error(ValueError("x"), "HTTPError")


def test_fuzz_draws_fresh_cases_and_records_every_server_error():
    """fuzz.py against a small in-process FastAPI app (no Ray): a route that answers 500 for a
    negative number is caught with the run's seed; a sound route has none; each run a new seed."""
    import threading

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict

    from fly_serve.runtime.tp import free_port
    from loadtest.fuzz import fuzz_app

    class Body(BaseModel):
        # strict: a negative case such as {"n": -219, "max_tokens": false} breaks the schema, and
        # lax pydantic would coerce false to 0 and reach the 500 (CI saw it; seed 185 of 300 did)
        model_config = ConfigDict(strict=True)
        n: int
        max_tokens: int = 1

    app = FastAPI()

    @app.post("/fragile")
    def fragile(body: Body):
        return JSONResponse({"error": "boom"}, status_code=500) if body.n < 0 else {"n": body.n}

    @app.post("/sound")
    def sound_route(body: Body):
        return {"n": body.n, "max_tokens": body.max_tokens}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert until(lambda: server.started or None, timeout_s=30, poll_s=0.05)
        url = f"http://127.0.0.1:{port}"
        first, second = fuzz_app(url, cases_per_route=40), fuzz_app(url, cases_per_route=40)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert first.seed != second.seed
    for run in (first, second):
        assert set(run.declared) == {"/fragile", "/sound"}
        assert [(r.route, r.mode) for r in run.routes] == [
            (route, mode) for route in ("POST /fragile", "POST /sound") for mode in ("positive", "negative")
        ]
        assert list(run.server_errors) == ["POST /fragile (positive)"]  # negative bodies get 422 first
        assert run.server_errors["POST /fragile (positive)"][0].startswith("500 ")
        sound = [r for r in run.routes if r.route == "POST /sound"]
        assert sum(r.cases for r in sound) >= 40 and set(sound[0].statuses) == {200}
        assert not any(status >= 500 for status in sound[1].statuses) and 422 in sound[1].statuses
        assert run.summary()["seed"] == run.seed and run.asked_per_route == 40
        assert run.summary()["routes_short_of_cases"][0] == "POST /fragile"  # its positive half stopped at a 500
