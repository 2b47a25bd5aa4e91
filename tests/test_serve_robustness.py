"""Serving that stays up: clients that leave at every stage, bad text, overload, API keys, error
bodies that reveal nothing, the body limit, health and readiness, metrics, draining.

Four small apps on one local Ray, deployed from one Serve config (tiny models, 127.0.0.1): "fly"
at / (TP=1, a small waiting queue), "locked" at /locked (an API key, and a remote timeout so
small that every round fails, for the server-error path), "budget" at /budget (a KV cache of
a few hundred tokens, for admission at the budget's edge) and "poison" at /poison (a target that
fails any forward holding tiny.POISON_ID: a request that fails for its own reasons). Plus unit tests of the pieces that
need no Ray.
"""

import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import requests
from serve_fixture import ROOT, free_port, stop_serve, wait_ready

from deployments.http.admission import Slots, serve_limits
from deployments.http.middleware import authorized, resolve_api_key
from deployments.http.openai_api import clean, error_body
from deployments.ingress.engine_loop import EngineLoop
from deployments.parts.remote_parts import RemoteScorer, RemoteTimeout
from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

MAX_BATCH, MAX_WAITING = 8, 4
APP = {"tiny": True, "max_batch": MAX_BATCH, "max_waiting": MAX_WAITING, "defaults": {"max_tokens": 16}}
KEY = "test-key-7f3a"
LOCKED = {"tiny": True, "max_batch": 2, "api_key": KEY, "call_timeout_s": 1e-6}
PROMPT = "hello hello hello"  # 17 tokens (the tiny tokenizer is byte-level)
POISON = {"target": "tiny:0:poison", "drafter": "tiny:1", "max_batch": 4, "defaults": {"max_tokens": 8}}
# KV need of a request: prompt + max_tokens + k + 1 (k = 15 by default, in ar mode too).
BUDGET_TOKENS = 512
BUDGET = {"tiny": True, "max_batch": 2, "max_waiting": 1, "kv_budget_tokens": BUDGET_TOKENS, "defaults": {"mode": "ar"}}
LONG = {"prompt": PROMPT, "max_tokens": 400, "fly": {"mode": "ar"}}  # ar: one token a round, so it lasts
TIMEOUT = 60  # every client call has one: nothing may hang

# What an error body must never show: tracebacks, Ray's internals, paths, addresses, escapes.
LEAKS = re.compile(r"Traceback|File \"|ActorID|actor_id|Actor|RayTaskError|/work/|/tmp/|\x1b|\d+\.\d+\.\d+\.\d+")


def config(ingress_cpus: float = 0.2) -> dict:
    """Both apps as one Serve config. Deployed from a config, a change to one deployment's
    options restarts that deployment alone (the drain test replaces the ingress this way)."""

    def app(name: str, prefix: str, args: dict) -> dict:
        ingress = {"name": "FlyIngress", "ray_actor_options": {"num_cpus": ingress_cpus}}
        return {"name": name, "route_prefix": prefix, "import_path": "deployments.app:build", "args": args} | {
            "deployments": [ingress]
        }

    apps = [app("fly", "/", APP), app("locked", "/locked", LOCKED), app("budget", "/budget", BUDGET)]
    return {"applications": [*apps, app("poison", "/poison", POISON)]}


def deploy(cfg: dict) -> None:
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    serve_api.serve_start().deploy_apps(ServeDeploySchema.model_validate(cfg))


APPS = {"fly", "locked", "budget", "poison"}


def wait_running(timeout_s: float = 240) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        apps = serve.status().applications
        if APPS <= set(apps) and all(apps[a].status == "RUNNING" for a in APPS):
            return
        time.sleep(0.5)
    raise AssertionError(f"not running: {serve.status().applications}")


@pytest.fixture(scope="module")
def url():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray
    from ray import serve

    # address "local": a Ray of its own, never a cluster another process on this machine started
    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(config())
    wait_running()
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    wait_ready(f"{base}/locked")
    wait_ready(f"{base}/budget")
    wait_ready(f"{base}/poison")
    yield base
    stop_serve()


def complete(url: str, timeout: float = TIMEOUT, **body) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout)


def assert_clean_error(r: requests.Response, status: int, param=None) -> dict:
    """An OpenAI error body with the request id of the X-Request-Id header, nothing inside."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["request_id"] == r.headers["X-Request-Id"] and err["request_id"]
    assert err["message"] and err["type"]
    assert not LEAKS.search(r.text), r.text
    if param is not None:
        assert err["param"] == param, err
    return err


def stats(url: str) -> dict:
    return requests.get(f"{url}/v1/fly/stats", timeout=TIMEOUT).json()


# ---- no Ray


def test_api_key_environment_wins(monkeypatch):
    monkeypatch.delenv("FLY_API_KEY", raising=False)
    assert resolve_api_key(None) is None and resolve_api_key("") is None
    assert resolve_api_key("profile") == b"profile"
    monkeypatch.setenv("FLY_API_KEY", "env")
    assert resolve_api_key("profile") == b"env"
    assert authorized("Bearer env", b"env") and authorized("bearer  env ", b"env")
    assert not authorized(None, b"env") and not authorized("Bearer nope", b"env") and not authorized("env", b"env")
    assert authorized(None, None)


def test_error_text_is_clean():
    assert clean("a\x1b[31mred\x1b[0m\x00 \ud800") == "ared ?"
    assert len(clean("x" * 10_000)) <= 500
    body = error_body("bad \x1b[1mthing", "prompt", request_id="cmpl-1")
    json.dumps(body).encode()  # encodes (no lone surrogates)
    assert body["error"] == {
        "message": "bad thing",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
        "request_id": "cmpl-1",
    }


def test_slots_are_bounded_and_given_back_once():
    slots = Slots(2)
    assert slots.take("a") and slots.take("b") and not slots.take("c")
    assert slots.give("a") and not slots.give("a") and len(slots) == 1
    assert slots.take("c")


class _Never:
    """A handle call that never answers."""

    def __init__(self):
        self.cancelled = False

    def result(self, timeout_s=None):
        time.sleep(timeout_s)
        raise TimeoutError

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        outer = self

        class _Method:
            def remote(self, *args):
                outer.calls.append(_Never())
                return outer.calls[-1]

        return _Method()


def test_remote_calls_time_out_and_releases_never_raise():
    handle = _Handle()
    scorer = RemoteScorer(handle, vocab_size=10, timeout_s=0.05)
    with pytest.raises(RemoteTimeout, match="target.verify"):
        scorer.verify([], None)
    assert handle.calls[-1].cancelled
    t0 = time.monotonic()
    scorer.release(["a"])  # logged, not raised; bounded by the timeout
    assert time.monotonic() - t0 < 1


def test_engine_loop_survives_a_failing_sink_and_reports_a_stuck_round():
    engine = build_engine("tiny:0", "tiny:1", max_model_len=256)
    loop = EngineLoop(engine, stuck_round_s=0.2)

    def broken_sink(update):
        raise RuntimeError("the handler's event loop is gone")

    loop.submit("hello", {"max_tokens": 4}, "r1", broken_sink).result(timeout=30)
    got = []
    loop.submit("hello", {"max_tokens": 4}, "r2", got.append).result(timeout=30)
    deadline = time.monotonic() + 30
    while not (got and got[-1].finish_reason) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got[-1].finish_reason == "length" and loop.problem() is None

    release = threading.Event()
    verify = engine.scorer.verify
    engine.scorer.verify = lambda rows, drafts: release.wait(30) and verify(rows, drafts)  # a hanging target
    loop.submit("hello", {"max_tokens": 2, "mode": "ar"}, "r3", got.append).result(timeout=30)
    deadline = time.monotonic() + 10  # the engine's thread starts the hanging round when it gets to it
    while "round has run" not in (loop.problem() or "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "round has run" in (loop.problem() or "")
    release.set()
    loop.stop("test over")
    loop.thread.join(30)
    assert loop.problem() == "the engine loop has stopped"


# ---- through Serve


def test_healthz_is_ready_after_start(url):
    body = requests.get(f"{url}/healthz", timeout=TIMEOUT).json()
    assert body == {"status": "ready", "engine_loop": True}
    assert complete(url, prompt=PROMPT).status_code == 200


def test_openapi_documents_the_request_bodies(url):
    from openapi_spec_validator import validate

    doc = requests.get(f"{url}/openapi.json", timeout=TIMEOUT).json()
    validate(doc)  # a valid OpenAPI document, every $ref resolving
    schemas = doc["components"]["schemas"]
    for path, required in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        body = doc["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        model = schemas[ref.rsplit("/", 1)[1]]
        assert body["required"] and required in model["required"], model
        assert {"max_tokens", "temperature", "stream", "fly"} <= set(model["properties"]), model["properties"].keys()
    fly = schemas["FlyOptions"]
    assert {"mode", "k", "theta", "window"} <= set(fly["properties"]) and fly["additionalProperties"] is False


def test_lone_surrogate_is_a_400_naming_the_field(url):
    headers = {"content-type": "application/json"}
    cases = [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    ]
    for path, raw, param in cases:
        r = requests.post(f"{url}{path}", data=raw.encode(), headers=headers, timeout=TIMEOUT)
        assert_clean_error(r, 400, param)
    assert complete(url, prompt=PROMPT, max_tokens=4).status_code == 200


def test_client_errors_carry_a_request_id_and_nothing_inside(url):
    assert_clean_error(complete(url, prompt="x", fly={"k": 0}), 400, "fly.k")
    assert_clean_error(complete(url, prompt="x", model="gpt-9"), 404, "model")
    r = requests.post(f"{url}/v1/completions", data=b"{not json", timeout=TIMEOUT)
    assert_clean_error(r, 400)
    r = requests.post(f"{url}/v1/completions", data=b"[1, 2]", timeout=TIMEOUT)
    assert_clean_error(r, 400)
    # a prompt whose length alone proves it past the context: refused before tokenizing
    assert_clean_error(complete(url, prompt="a" * 200_000), 400, "prompt")


def test_body_limit_is_413_before_parsing(url):
    t0 = time.monotonic()
    r = requests.post(
        f"{url}/v1/completions",
        data=json.dumps({"prompt": "a" * (20 * 2**20)}).encode(),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert_clean_error(r, 413)
    assert time.monotonic() - t0 < 30

    def chunks():  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a" * 2**20
        yield b'"}'

    r = requests.post(f"{url}/v1/completions", data=chunks(), timeout=TIMEOUT)
    assert_clean_error(r, 413)
    assert complete(url, prompt=PROMPT, max_tokens=4).status_code == 200


def test_overload_is_503_with_retry_after_and_nothing_hangs(url):
    n = 4 * (MAX_BATCH + MAX_WAITING)
    with ThreadPoolExecutor(n) as pool:
        rs = list(pool.map(lambda _: complete(url, **LONG, timeout=120), range(n)))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503}, codes
    assert 200 in codes and 503 in codes, codes
    for r in rs:
        if r.status_code == 503:
            err = assert_clean_error(r, 503)
            assert (err["type"], err["code"]) == ("server_error", "overloaded")
            assert int(r.headers["Retry-After"]) >= 1
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    assert wait_idle(url)["in_flight"] == 0


def test_overload_past_serves_own_limits_is_still_our_503(url):
    """More connections at once than the ingress replica takes (Serve's max_ongoing_requests):
    the extra ones wait in Serve's queue, which never sheds, and get our 503 in turn."""
    # more than Serve's old limits too (64 ongoing + 64 queued), past which it answered its own 503
    n = serve_limits(MAX_BATCH, MAX_WAITING)["max_ongoing_requests"] + 72
    with ThreadPoolExecutor(n) as pool:
        rs = list(pool.map(lambda _: complete(url, **LONG, timeout=180), range(n)))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= MAX_BATCH and codes.count(503) >= n // 2, codes
    for r in rs:
        if r.status_code == 503:  # every one is ours: the OpenAI error body, never Serve's text
            err = assert_clean_error(r, 503)
            assert err["code"] == "overloaded" and r.headers["Retry-After"]
    assert wait_idle(url)["in_flight"] == 0


# ---- admission at the KV budget's edge (the "budget" app)


def test_kv_budget_is_the_same_on_the_target(url):
    from ray import serve

    target = serve.get_deployment_handle("FlyTarget", app_name="budget")
    assert target.report.remote().result(timeout_s=30).rank_kv_capacities == [BUDGET_TOKENS]
    assert stats(f"{url}/budget")["capacity"] == BUDGET["max_batch"] + BUDGET["max_waiting"]


def test_kv_budget_admission_through_http(url):
    """One request that fills most of the budget runs alone (the batch has room for two); two
    that fit only later wait and are answered; one that can never fit gets a 400 at once; one
    past the full queue gets a 503."""
    budget = f"{url}/budget"
    big = {"prompt": PROMPT, "max_tokens": 450}  # 17 + 450 + 16 = 483 of 512 tokens
    small = {"prompt": PROMPT, "max_tokens": 100}  # 133: fits beside another small one, not beside big
    first = requests.post(f"{budget}/v1/completions", json={**big, "stream": True}, stream=True, timeout=TIMEOUT)
    assert first.status_code == 200
    lines = first.iter_lines(decode_unicode=True)
    next(lines)  # generating
    never = complete(budget, prompt=PROMPT, max_tokens=600)  # 633 > 512
    running = stats(budget)["running"]  # the big one still runs: the 400 did not wait for it
    with ThreadPoolExecutor(2) as pool:
        later = [pool.submit(complete, budget, **small, timeout=120) for _ in range(2)]
        deadline = time.monotonic() + 30
        while (s := stats(budget))["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (s["running"], s["waiting"]) == (1, 2), s  # waiting for KV blocks, not for the batch
        full = complete(budget, prompt=PROMPT, max_tokens=4)  # a 4th in flight: past max_batch + max_waiting
        s = stats(budget)
        answered = [f.result() for f in later]
    events = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    first.close()
    err = assert_clean_error(never, 400, "max_tokens")
    assert f"KV cache of {BUDGET_TOKENS} tokens" in err["message"] and running == 1, (err, running)
    assert (s["running"], s["waiting"]) == (1, 2), s  # the 503 came while the small ones still waited
    err = assert_clean_error(full, 503)
    assert err["code"] == "overloaded"
    last = events[-1]
    assert last["usage"]["completion_tokens"] == 450 and last["fly"]["max_batch_size"] == 1
    for r in answered:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 100 and body["fly"]["max_batch_size"] == 2
    assert wait_idle(budget)["in_flight"] == 0


# ---- clients that leave


def raw_request(url: str, body: dict | None = None, path: str = "/v1/completions") -> tuple[socket.socket, bytes]:
    """A connected socket and the bytes of a POST of `body`."""
    u = urlparse(url)
    data = json.dumps(body or {}).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    return socket.create_connection((u.hostname, u.port), timeout=TIMEOUT), head + data


def hang_up_after_sending(url: str, wait_s: float, body: dict) -> None:
    s, data = raw_request(url, body)
    s.sendall(data)
    time.sleep(wait_s)
    s.close()


def hang_up_mid_body(url: str) -> None:
    s, data = raw_request(url, {"prompt": PROMPT * 50})
    s.sendall(data[: len(data) - 100])
    time.sleep(0.05)
    s.close()


def hang_up_on_a_timeout(url: str, timeout: float) -> None:
    try:
        complete(url, timeout=timeout, **LONG)
    except requests.exceptions.Timeout:
        pass


def hang_up_mid_stream(url: str, events: int) -> None:
    with requests.post(f"{url}/v1/completions", json={**LONG, "stream": True}, stream=True, timeout=TIMEOUT) as r:
        if r.status_code != 200:
            return  # turned away (at capacity): leaving is moot
        lines = r.iter_lines()
        for _ in range(events):
            next(lines, None)


def hang_up_in_the_last_round(url: str) -> None:
    """Reads up to the chunk that carries finish_reason and leaves before [DONE]."""
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "fly": {"mode": "fly", "k": 4, "window": 1}}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=TIMEOUT) as r:
        if r.status_code != 200:
            return  # turned away (at capacity, slots of clients that left not yet freed): leaving is moot
        for line in r.iter_lines(decode_unicode=True):
            if line and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["finish_reason"]:
                break


def wait_idle(url: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(url)
        if (s["running"], s["waiting"], s["in_flight"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


STAGES = [
    lambda url: hang_up_after_sending(url, 0.0, LONG),  # before the handler runs
    lambda url: hang_up_mid_body(url),  # while the body is read
    lambda url: hang_up_after_sending(url, 0.03, LONG),  # tokenizing, in the inbox, or just admitted
    lambda url: hang_up_on_a_timeout(url, 0.3),  # admitted, non-streaming, mid-generation
    lambda url: hang_up_mid_stream(url, 1),  # after admission, around the first token
    lambda url: hang_up_mid_stream(url, 4),  # mid-stream
    lambda url: hang_up_in_the_last_round(url),  # the last round
]


def test_clients_leaving_at_every_stage_leave_nothing_behind(url):
    # A full batch of long streams, so that the storm's requests also wait in the queue and
    # leave from there; the long streams themselves are left mid-stream at the end.
    held = [
        requests.post(f"{url}/v1/completions", json={**LONG, "stream": True}, stream=True, timeout=TIMEOUT)
        for _ in range(MAX_BATCH)
    ]
    lines = [r.iter_lines() for r in held]  # kept: a dropped line iterator closes its connection
    for r, it in zip(held, lines):
        assert r.status_code == 200
        next(it)
    before = stats(url)
    assert before["running"] == MAX_BATCH
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: STAGES[i % len(STAGES)](url), range(3 * len(STAGES))))
    for r in held:
        r.close()
    with ThreadPoolExecutor(4) as pool:  # and with room in the batch
        list(pool.map(lambda i: STAGES[i % len(STAGES)](url), range(4 * len(STAGES))))

    idle = wait_idle(url)
    assert (idle["running"], idle["waiting"], idle["in_flight"]) == (0, 0, 0), idle
    # the held streams (and more) were aborted, not run to their length
    aborted = idle["finished"].get("abort", 0) - before["finished"].get("abort", 0)
    assert aborted >= MAX_BATCH, (before["finished"], idle["finished"])
    assert requests.get(f"{url}/healthz", timeout=TIMEOUT).status_code == 200
    ok = complete(url, prompt=PROMPT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    with ThreadPoolExecutor(MAX_BATCH) as pool:  # the freed KV slots serve a full batch again
        rs = list(pool.map(lambda i: complete(url, prompt=f"{PROMPT} {i}", max_tokens=24), range(MAX_BATCH)))
    assert [r.status_code for r in rs] == [200] * MAX_BATCH
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in rs)


# ---- the locked app: API key, and a server error


def test_api_key_is_required_on_v1_only(url):
    locked = f"{url}/locked"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.get(f"{locked}/v1/models", headers=headers, timeout=TIMEOUT)
        err = assert_clean_error(r, 401)
        assert err["code"] == "invalid_api_key" and KEY not in r.text
        r = requests.post(f"{locked}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=TIMEOUT)
        assert_clean_error(r, 401)
    r = requests.get(f"{locked}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny:0"
    assert requests.get(f"{locked}/healthz", timeout=TIMEOUT).status_code == 200


def test_a_failed_generation_says_only_to_quote_the_request_id(url):
    locked, auth = f"{url}/locked", {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": PROMPT, "max_tokens": 4, "fly": {"mode": "ar"}}
    r = requests.post(f"{locked}/v1/completions", json=body, headers=auth, timeout=TIMEOUT)
    err = assert_clean_error(r, 500)
    assert err["type"] == "server_error"
    assert err["message"] == f"generation failed; quote request id {err['request_id']}"

    with requests.post(
        f"{locked}/v1/completions", json={**body, "stream": True}, headers=auth, stream=True, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        rid = r.headers["X-Request-Id"]
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["message"] == f"generation failed; quote request id {rid}" and err["request_id"] == rid
    assert not LEAKS.search("".join(events))
    # a request that fails for its own reasons is no fault of the service: the prober asks the
    # parts, they answer, and /healthz never turns 503 (issue 17 item 4)
    for _ in range(10):
        assert requests.get(f"{locked}/healthz", timeout=TIMEOUT).status_code == 200
        time.sleep(0.2)
    r = requests.post(f"{locked}/v1/completions", json=body, headers=auth, timeout=TIMEOUT)
    assert_clean_error(r, 500)  # admitted (not a 503): it fails for its own reasons again


def test_a_poison_request_fails_alone_and_the_service_stays_healthy(url):
    """Issue 17: a request that fails for its own reasons (its prompt breaks the target's forward)
    fails with its clean error, alone in the batch or beside healthy requests, which are answered;
    /healthz stays 200, and a healthy request sent right after is answered."""
    from fly_serve.loading.tiny import POISON_ID

    poison = f"{url}/poison"
    bad = {"prompt": f"ring the bell {chr(POISON_ID)} now", "max_tokens": 8}
    good = {"prompt": PROMPT, "max_tokens": 8}
    err = assert_clean_error(requests.post(f"{poison}/v1/completions", json=bad, timeout=TIMEOUT), 500)
    assert err["message"] == f"generation failed; quote request id {err['request_id']}"
    for _ in range(10):
        assert requests.get(f"{poison}/healthz", timeout=TIMEOUT).status_code == 200
        time.sleep(0.2)
    r = requests.post(f"{poison}/v1/completions", json=good, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    with ThreadPoolExecutor(3) as pool:  # in one batch: bisection fails the poison row alone
        answers = list(
            pool.map(lambda b: requests.post(f"{poison}/v1/completions", json=b, timeout=TIMEOUT), [good, bad, good])
        )
    assert [a.status_code for a in answers] == [200, 500, 200], [a.text for a in answers]
    assert requests.get(f"{poison}/healthz", timeout=TIMEOUT).status_code == 200


def test_request_metrics_are_exported(url):
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = {
        "ray_fly_num_requests_waiting",
        "ray_fly_num_requests_running",
        "ray_fly_time_to_first_token_seconds_count",
        "ray_fly_time_per_output_token_seconds_count",
        "ray_fly_num_requests_failed_total",
    }
    reasons = {"rejected", "overloaded", "error"}
    found, seen = set(), set()
    for _ in range(30):  # the agent exports every few seconds
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found = set(re.findall(r"^(ray_fly_\w+)", text, re.M))
        seen = set(re.findall(r'^ray_fly_num_requests_failed_total\{.*reason="(\w+)"', text, re.M))
        if wanted <= found and reasons <= seen:
            break
        time.sleep(2)
    assert wanted <= found and reasons <= seen, (wanted - found, seen)


# ---- draining and replacing the ingress (last: it leaves "fly" drained until replaced)


def test_drain_turns_new_requests_away_and_a_replaced_ingress_finishes_its_streams(url):
    from ray import serve

    def stream(max_tokens: int) -> requests.Response:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "fly": {"mode": "ar"}}
        r = requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=TIMEOUT)
        assert r.status_code == 200
        return r

    streams = [stream(600), stream(600)]
    lines = [r.iter_lines(decode_unicode=True) for r in streams]  # kept: dropping one closes the stream
    for it in lines:
        next(it)
    assert serve.get_app_handle("fly").drain.remote().result(timeout_s=30) == 2
    err = assert_clean_error(complete(url, prompt=PROMPT), 503)
    assert err["code"] == "draining" and complete(url, prompt=PROMPT).headers["Retry-After"]
    health = requests.get(f"{url}/healthz", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json()["status"] == "draining"

    # Serve replaces the ingress alone (the target and drafter stay): the old replica is
    # stopped only after its streams have ended, within graceful_shutdown_timeout_s.
    deploy(config(ingress_cpus=0.25))
    for it, r in zip(lines, streams):
        events = [line[6:] for line in it if line]
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 600
        r.close()
    wait_running()
    wait_ready(url)  # the new replica admits again
    assert complete(url, prompt=PROMPT).status_code == 200
