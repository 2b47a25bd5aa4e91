"""Hostile input through the served API (issue 47), over HTTP on 127.0.0.1 against one small app
(tiny models, both in the ingress as the default profile has them, a short body deadline):
deeply nested JSON, slow bodies, grammars the library cannot follow or that nothing completes,
a json_schema without its schema, fields that would change the output and are not applied, seeds
in the modes whose drafts come from what the engine learned, and the validation of roles, prompt
lengths and forms, seeds at the ends of int64, a deep schema and clients gone before their body.
Bad input gets a 4xx naming the field, never a 500 or a 200 that silently lacks what was asked,
and a generation in flight beside it ends whole."""

import http.client
import json
import os
import re
import socket
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests
from serve_fixture import start_serve, stop_serve

from deployments.http.admission import serve_limits
from fly_serve.engine.params import MAX_STOP_CHARS
from loadtest.scenarios import App, hostile_input, slow_flood
from loadtest.waits import until

pytestmark = pytest.mark.serve

BODY_TIMEOUT_S = 3.0  # the app's body deadline, short for the test (the default is 20 s)
MAX_BATCH, MAX_WAITING = 2, 2  # 4 slots: a few slow sockets would take them all if they held one
MAX_MODEL_LEN = 512
APP = {
    "tiny": True,
    "max_batch": MAX_BATCH,
    "max_waiting": MAX_WAITING,
    "max_model_len": MAX_MODEL_LEN,
    "body_timeout_s": BODY_TIMEOUT_S,
    "target_placement": "ingress",
    "drafter_placement": "ingress",
    "defaults": {"max_tokens": 16},
}
PROMPT = "def add(a, b):\n    return a + b\n"
MESSAGES = [{"role": "user", "content": "Say something."}]
WITNESS_TOKENS = 400  # ar, one token a round: still generating while the bad requests come
TIMEOUT = 60
SLOW_SOCKETS = 2 * (MAX_BATCH + MAX_WAITING)


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    deadline = time.monotonic() + 120
    while requests.get(f"{base}/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "not ready"
        time.sleep(0.5)
    yield base
    stop_serve()


def post(url: str, route: str = "completions", **body) -> requests.Response:
    return requests.post(f"{url}/v1/{route}", json=body, timeout=TIMEOUT)


def post_raw(url: str, raw: bytes | str, route: str = "completions", headers: dict | None = None):
    headers = {"content-type": "application/json", **(headers or {})}
    return requests.post(f"{url}/v1/{route}", data=raw, headers=headers, timeout=TIMEOUT)


def refused(r: requests.Response, param: str | None, status: int = 400) -> str:
    """The error's message, once the answer is the status with an OpenAI error naming `param`."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


def stats(url: str) -> dict:
    return requests.get(f"{url}/v1/fly/stats", timeout=TIMEOUT).json()


@contextmanager
def in_flight_beside(url: str):
    """A streamed generation admitted before the block runs: it must end whole after it, all
    its tokens and [DONE] (nothing beside a bad request is lost)."""
    body = {"prompt": PROMPT, "max_tokens": WITNESS_TOKENS, "stream": True, "fly": {"mode": "ar"}}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.text
        lines = r.iter_lines(decode_unicode=True)
        first = next(line for line in lines if line)
        yield
        events = [first, *(line for line in lines if line)]
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length", last
    assert last["usage"]["completion_tokens"] == WITNESS_TOKENS, last


def wait_idle(url: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (s := stats(url))["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return s


# ---- 1. deeply nested JSON


@pytest.mark.parametrize(
    "raw, route",
    [
        ("[" * 100_000 + "]" * 100_000, "completions"),
        ('{"prompt": "x", "junk": ' + "[" * 100_000 + "]" * 100_000 + "}", "completions"),
        ('{"messages": [], "x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}", "chat/completions"),
    ],
    ids=["array", "in-an-unknown-field", "objects-on-chat"],  # short: a test id travels in the environment
)
def test_deeply_nested_json_is_a_400(url, raw, route):
    with in_flight_beside(url):
        message = refused(post_raw(url, raw, route), None)
    assert "nested too deeply" in message


# ---- 2. slow bodies


def slow_body(url: str) -> socket.socket:
    """A POST that declares 200 bytes of body and sends a few of them."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=TIMEOUT)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: 200\r\n\r\n".encode() + b'{"prompt": ')
    return s


def test_slow_bodies_hold_no_slot_and_are_cut_at_the_deadline(url):
    """Twice as many sockets as the replica has slots send a body that never completes: a
    request beside them is answered (no slot is held by a body being read), and each of them
    gets a 408 once the body deadline has passed."""
    with in_flight_beside(url):
        t0 = time.monotonic()
        sockets = [slow_body(url) for _ in range(SLOW_SOCKETS)]
        time.sleep(0.5)  # every one of them is in a handler, reading its body
        r = post(url, prompt=PROMPT, max_tokens=4)
        assert r.status_code == 200, r.text
        assert stats(url)["in_flight"] <= 1  # the stream beside; nothing of the slow bodies
        answers = []
        for s in sockets:
            response = http.client.HTTPResponse(s)
            response.begin()
            answers.append((response.status, json.loads(response.read())["error"]["code"], time.monotonic() - t0))
            s.close()
    assert all(a[:2] == (408, "request_timeout") for a in answers), answers
    assert all(BODY_TIMEOUT_S - 0.5 < a[2] < BODY_TIMEOUT_S + 15 for a in answers), answers
    assert wait_idle(url)["in_flight"] == 0


def test_slow_bodies_past_the_ingress_limit_hold_up_neither_healthz_nor_a_request(url):
    """Three times as many sockets as the ingress's Serve limit (max_ongoing_requests) send their
    headers and part of a body. Their bodies are read in the HTTP proxy (proxy_guard.py), so no
    Serve place of the replica is held: /healthz and a request beside them are answered before
    any body deadline has passed (a replica that read bodies itself queued both behind them until
    deadlines freed places), and every socket gets its 408, those cut to make room for newer
    reads at once and the rest at the deadline."""
    limit = serve_limits(MAX_BATCH, MAX_WAITING)["max_ongoing_requests"]
    with in_flight_beside(url):
        t0 = time.monotonic()
        sockets = [slow_body(url) for _ in range(3 * limit)]
        time.sleep(0.5)
        health = requests.get(f"{url}/healthz", timeout=TIMEOUT)
        health_s = time.monotonic() - t0
        r = post(url, prompt=PROMPT, max_tokens=4)
        request_s = time.monotonic() - t0
        answers = []
        for s in sockets:
            response = http.client.HTTPResponse(s)
            response.begin()
            answers.append((response.status, json.loads(response.read())["error"]["code"]))
            s.close()
    assert health.status_code == 200 and r.status_code == 200, (health.text, r.text)
    assert health_s < BODY_TIMEOUT_S and request_s < BODY_TIMEOUT_S, (health_s, request_s)
    assert set(answers) == {(408, "request_timeout")}, answers
    assert wait_idle(url)["in_flight"] == 0


@pytest.mark.parametrize("header", ["X-Request-Id", "X-Session-Id", "serve_multiplexed_model_id"])
def test_a_header_serve_reads_that_is_not_utf8_is_a_400_naming_it(url, header):
    """Serve's proxy decodes these headers as UTF-8; bytes that are not were its plain-text 500,
    unlogged. The proxy's guard answers a 400 in OpenAI's error body, naming the header."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT) as s:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n".encode()
            + header.encode()
            + b": \xff\xfeid\r\n\r\n"
            + body
        )
        response = http.client.HTTPResponse(s)
        response.begin()
        err = json.loads(response.read())["error"]
    assert response.status == 400, err
    assert err["param"].lower() == header.lower() and "UTF-8" in err["message"], err
    assert post(url, prompt=PROMPT, max_tokens=2).status_code == 200


def test_a_slow_body_that_completes_in_time_is_served(url):
    u = urlparse(url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    with socket.create_connection((u.hostname, u.port), timeout=TIMEOUT) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        for i in range(0, len(body), 8):  # dribbled over about half the deadline
            s.sendall(body[i : i + 8])
            time.sleep(BODY_TIMEOUT_S / 2 / (len(body) / 8))
        response = http.client.HTTPResponse(s)
        response.begin()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 4


# ---- 3. and 4. grammars the library cannot follow, or that no text completes

A_MILLION_AS = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a{1000000}$"}},
}
LOOPING_REFS = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", {"response_format": A_MILLION_AS}, "response_format"),
        ("chat/completions", {"response_format": A_MILLION_AS}, "response_format"),
        ("completions", {"fly": {"regex": "(a{1000}){1000}"}}, "fly.regex"),
    ],
)
def test_a_grammar_the_library_cannot_follow_is_a_400(url, route, body, param):
    """The library builds its lexer lazily: these fail on their first token ("too many
    expressions constructed"), which used to end the request at once as a 200 "stop" with no
    text. They are walked a few tokens before admission now."""
    head = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    with in_flight_beside(url):
        message = refused(post(url, route, **head, **body, max_tokens=8), param)
    assert "too many expressions" in message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"fly": {"grammar": "start: x\nx: x"}}, "fly.grammar"),
        ({"fly": {"grammar": 'start: "a" x\nx: x'}}, "fly.grammar"),  # a dead end after its first token
        ({"response_format": schema_format({"$ref": "#"})}, "response_format"),
        ({"response_format": schema_format(LOOPING_REFS)}, "response_format"),
    ],
)
def test_a_grammar_no_text_completes_is_a_400(url, body, param):
    message = refused(post(url, prompt=PROMPT, max_tokens=8, **body), param)
    assert "no text matches it" in message


# A 51-character literal, then a rule no text completes: past the tokens admission walks, so the
# dead end is met while generating (issue 54: a 500 "generation failed")
LATE_DEAD_END = 'start: "' + "a" * 51 + '" x\nx: x "b"'


def test_a_grammar_dead_end_met_while_generating_is_the_clients_error(url):
    """Not a server failure: a 400 naming the field before any byte is sent, and for a stream
    already under way a last event of the client's error type (then [DONE]); the stream beside
    it ends whole."""
    body = {"prompt": PROMPT, "max_tokens": 80, "fly": {"mode": "ar", "grammar": LATE_DEAD_END}}
    with in_flight_beside(url):
        message = refused(post(url, **body), "fly.grammar")
        with requests.post(f"{url}/v1/completions", json=body | {"stream": True}, stream=True, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert "no way on" in message and "no text matches it" in message, message
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: ") :])["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "fly.grammar", err
    text = "".join(json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-2])
    assert text == "a" * 51  # the literal, streamed before the dead end


@pytest.mark.parametrize("field, value", [("regex", "a\ud800b"), ("grammar", 'start: "\ud800"')])
def test_a_lone_surrogate_in_a_grammar_is_a_400_naming_it(url, field, value):
    message = refused(post(url, prompt=PROMPT, max_tokens=4, fly={field: value}), f"fly.{field}")
    assert "Unicode" in message


# ---- 5. a json_schema format without its schema


@pytest.mark.parametrize(
    "response_format, missing",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "strict": True}}, "json_schema.schema"),
        ({"type": "json_schema"}, "json_schema"),
    ],
)
def test_a_json_schema_format_without_its_schema_is_a_400(url, response_format, missing):
    for route, head in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES})):
        message = refused(post(url, route, **head, response_format=response_format), "response_format")
        assert missing in message


# ---- 6. fields that change the output and are not applied

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("completions", {"regex": "[a-z]+"}, "regex"),
        ("chat/completions", {"grammar": 'start: "yes"'}, "grammar"),
        ("chat/completions", {"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"tools": [TOOL]}, "tools"),
        ("chat/completions", {"functions": [TOOL["function"]]}, "functions"),
        ("completions", {"suffix": "\n}"}, "suffix"),
        ("completions", {"top_k": 5}, "top_k"),
        ("completions", {"min_p": 0.1}, "min_p"),
        ("completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("completions", {"ignore_eos": True}, "ignore_eos"),
    ],
)
def test_a_field_that_would_change_the_output_and_is_not_applied_is_a_400(url, route, extra, param):
    head = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    message = refused(post(url, route, **head, **extra, max_tokens=4), param)
    assert param in message


def test_the_neutral_values_of_those_fields_are_accepted(url):
    """What clients send by default (OpenAI's and vLLM's neutral values), and fields that change
    nothing of the output, are no reason to refuse a request."""
    neutral = {
        "top_k": -1,
        "min_p": 0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "tools": [TOOL],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "ignore_eos": False,
        "user": "u-1",
        "service_tier": "auto",
    }
    r = post(url, "chat/completions", messages=MESSAGES, max_tokens=4, **neutral)
    assert r.status_code == 200, r.text
    r = post(url, prompt=PROMPT, max_tokens=4, suffix="", top_k=0, min_p=0.0)
    assert r.status_code == 200, r.text


# ---- 7. seeds in the modes whose drafts the engine learned


def test_a_seed_gives_the_same_text_in_every_model_free_mode(url):
    """T = 1, one seed: suffix and recycle draft from what earlier requests taught the engine, so
    each repetition drafts differently; the text must not change (nor differ from ar's)."""
    texts, drafted = {}, {}
    for mode in ("ar", "pld", "suffix", "suffix", "suffix", "recycle", "recycle", "recycle"):
        r = post(url, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7, fly={"mode": mode, "k": 4})
        assert r.status_code == 200, r.text
        texts.setdefault(mode, []).append(r.json()["choices"][0]["text"])
        drafted.setdefault(mode, []).append(r.json()["fly"]["drafted"])
    assert all(t == texts["ar"][0] for ts in texts.values() for t in ts), texts
    assert drafted["suffix"][-1] > 0 and drafted["recycle"][-1] > 0, drafted  # they did draft


# ---- 8. validation


@pytest.mark.parametrize("role, says", [('"bogus"', "'assistant'"), ('""', "'user'"), ('"\\ud800"', "unicode")])
def test_a_message_role_is_one_of_openais(url, role, says):
    raw = '{"messages": [{"role": ' + role + ', "content": "hi"}], "max_tokens": 2}'
    assert says in refused(post_raw(url, raw, "chat/completions"), "messages.0.role")


def test_developer_and_tool_roles_are_served(url):
    tool = {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    messages = [{"role": "developer", "content": "Be brief."}, *MESSAGES, tool]
    assert post(url, "chat/completions", messages=messages, max_tokens=2).status_code == 200


def prompt_tokens(url: str, messages: list[dict], **extra) -> int:
    r = post(url, "chat/completions", messages=messages, max_tokens=1, **extra)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_a_developer_message_is_the_system_message_of_a_model_without_that_role(url):
    """OpenAI: developer messages replace system messages; for a model whose template has no
    developer role it is its system message, not a turn it never saw (or none at all)."""
    system = prompt_tokens(url, [{"role": "system", "content": "Be brief."}, *MESSAGES])
    assert prompt_tokens(url, [{"role": "developer", "content": "Be brief."}, *MESSAGES]) == system
    assert prompt_tokens(url, MESSAGES) < system


def test_content_as_text_parts_is_the_text_they_join(url):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]
    joined = prompt_tokens(url, [{"role": "user", "content": "Say\nsomething."}])
    assert prompt_tokens(url, [{"role": "user", "content": parts}]) == joined
    image = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]
    message = refused(
        post(url, "chat/completions", messages=[{"role": "user", "content": image}]), "messages.0.content.0.type"
    )
    assert "only text" in message


def test_an_assistant_turns_tool_calls_are_never_dropped(url):
    """This template cannot show tool calls: the turn that made them is refused, naming them (the
    default model's template renders them: test_openai_shapes.py), never sent without them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    for content in (None, "Let me look."):
        turns = [*MESSAGES, {"role": "assistant", "content": content, "tool_calls": [call]}]
        turns.append({"role": "tool", "content": "12:00", "tool_call_id": "call_1"})
        assert "tool calls" in refused(post(url, "chat/completions", messages=turns), "messages.1.tool_calls")
    assert "required" in refused(
        post(url, "chat/completions", messages=[{"role": "user", "content": None}]), "messages.0.content"
    )


def test_openais_nulls_are_its_defaults(url):
    """n, stream and the optional fields as null: what OpenAI (and its SDKs) send for "unset"."""
    for route, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES})):
        r = post(url, route, **body, max_tokens=2, n=None, stream=None, stream_options=None, stop=None, seed=None)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_stream_options_without_stream_is_a_400_as_openai_answers(url):
    for stream in (False, None):
        r = post(url, prompt=PROMPT, max_tokens=2, stream=stream, stream_options={"include_usage": True})
        assert "only allowed when 'stream' is enabled" in refused(r, "stream_options")


@pytest.mark.parametrize("field, value", [("temperature", 2.5), ("temperature", 50), ("top_p", 1.5)])
def test_sampling_knobs_are_in_openais_ranges(url, field, value):
    assert "must be in [0, " in refused(post(url, prompt=PROMPT, max_tokens=2, **{field: value}), field)


def test_stop_is_bounded_as_openai_bounds_it(url):
    """At most 4 stop strings (OpenAI's), each of MAX_STOP_CHARS at most: what a stream holds back
    and what the engine thread matches every round has a bound."""
    assert "at most 4" in refused(post(url, prompt=PROMPT, max_tokens=2, stop=["a", "b", "c", "d", "e"]), "stop")
    long = "x" * (MAX_STOP_CHARS + 1)
    assert f"at most {MAX_STOP_CHARS}" in refused(post(url, prompt=PROMPT, max_tokens=2, stop=[long]), "stop")
    r = post(url, prompt=PROMPT, max_tokens=2, stop=["y" * MAX_STOP_CHARS] * 4)
    assert r.status_code == 200, r.text


def test_a_prompt_past_the_context_is_blamed_on_the_prompt(url):
    message = refused(post(url, prompt=[5] * (MAX_MODEL_LEN + 88), max_tokens=4), "prompt")
    assert f"context window of {MAX_MODEL_LEN} tokens" in message
    long_chat = [{"role": "user", "content": "ab" * MAX_MODEL_LEN}]
    refused(post(url, "chat/completions", messages=long_chat, max_tokens=4), "messages")
    refused(post(url, prompt=[5] * 100, max_tokens=MAX_MODEL_LEN), "max_tokens")  # where max_tokens is to blame


def test_a_seed_is_any_int64(url):
    for seed in (-(2**63), 2**63 - 1):
        r = post(url, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=seed)
        assert r.status_code == 200, (seed, r.text)
    for seed in (-(2**63) - 1, 2**63):
        refused(post(url, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=seed), "seed")


def deep_schema(levels: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def test_a_deep_valid_schema_is_served(url):
    """300 nested objects: 600 levels of JSON, past the 128 the grammar library reads; its
    subschemas are moved to $defs, so it compiles, and the output follows it."""
    r = post(url, prompt=PROMPT, max_tokens=40, response_format=schema_format(deep_schema(300)))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith('{"a": {"a": {"a": ') and choice["finish_reason"] == "length", choice


def test_a_batch_of_one_token_list_is_a_prompt_and_other_forms_are_named(url):
    one = post(url, prompt=[[104, 105, 33]], max_tokens=6, fly={"mode": "ar"})
    plain = post(url, prompt=[104, 105, 33], max_tokens=6, fly={"mode": "ar"})
    assert one.status_code == plain.status_code == 200, one.text
    assert one.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert "one per request" in refused(post(url, prompt=[[1, 2], [3]]), "prompt")
    for bad in (5, [1.5], [[1, "a"]], {"text": "x"}):
        assert "a list of token ids" in refused(post(url, prompt=bad), "prompt")


def ingress_log(request_ids: list[str]) -> list[str]:
    """The log lines of the ingress replica and of the HTTP proxy (whose guard reads the bodies:
    deployments/http/proxy_guard.py) that name one of these request ids."""
    import ray

    # the session of this module's Ray (not /tmp/ray/session_latest: another Ray may be newer)
    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs" / "serve"
    files = [*logs.glob("replica_fly_FlyIngress_*.log"), *logs.glob("proxy_*.log")]
    lines = [line for f in files for line in f.read_text("utf-8", "replace").splitlines()]
    return [line for line in lines if any(rid in line for rid in request_ids)]


def leave_before_the_body(url: str, request_id: str, sent: bytes, wait_s: float, reset: bool) -> None:
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=TIMEOUT)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: {request_id}\r\n"
        f"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n".encode()
        + sent
    )
    time.sleep(wait_s)
    if reset:  # an abortive close: RST, not FIN
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_clients_gone_before_their_body_was_read_are_no_error(url):
    """Clients that leave before their body is read (at once, midway, by RST, beside the body
    deadline) are no fault of the server: nothing of them is left, and the log has no ERROR."""
    cases = [(b"", 0.0, False), (b'{"prompt": ', 0.05, False), (b'{"prompt": "x', 0.5, True)]
    cases += [(b'{"prompt": ', BODY_TIMEOUT_S - 0.2, False), (b"{", 1.0, True)]
    ids = [f"gone-before-body-{i}-{time.monotonic_ns()}" for i in range(len(cases))]
    with in_flight_beside(url):
        threads = [
            threading.Thread(target=leave_before_the_body, args=(url, rid, *case)) for rid, case in zip(ids, cases)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert wait_idle(url)["in_flight"] == 0

    # Each request's end is logged as its client's leaving: by the proxy's body guard, which reads
    # bodies before Serve queues the request ("the client left before its body was read"), or,
    # for one that reached the ingress, 499 or CANCELLED; never a 5xx, never an ERROR. Those that
    # waited half a second or more were seen for sure. The log is read where this module's Ray
    # writes it: a log not found fails here, as a request logged as a failure does.
    def ends():
        lines = [line for line in ingress_log(ids) if "POST /v1/completions" in line]
        got = {rid: [line for line in lines if rid in line] for rid in ids}
        return got if all(got[rid] for rid, case in zip(ids, cases) if case[1] >= 0.5) else None

    ended = until(ends, 10, 0.2)
    assert ended is not None, f"the ingress log has no end for {ids}"
    print(f"\n[gone before body] {ended}", flush=True)
    left = r"POST /v1/completions (499|CANCELLED) |POST /v1/completions: the client left before its body was read"
    assert all(re.search(left, line) for v in ended.values() for line in v)
    assert not [line for line in ingress_log(ids) if " ERROR " in line or line.startswith("ERROR")]
    assert post(url, prompt=PROMPT, max_tokens=4).status_code == 200


# ---- the same through loadtest's scenario (fault_run's "hostile" phase)


def test_the_hostile_scenario_of_the_fault_run_holds(url):
    run = hostile_input(App(url, os.getpid()), MAX_BATCH + MAX_WAITING, BODY_TIMEOUT_S, WITNESS_TOKENS, 4)
    assert run.held, run.summary()
    assert len(run.slow) == MAX_BATCH + MAX_WAITING + 4 and len(run.in_flight) == 2
    assert run.summary()["status_500"] == 0 and len(run.stops) == 4 and len(run.dead_end) == 2


def test_the_slow_flood_of_the_fault_run_holds(url):
    """The fault run's flood: 3x the ingress's Serve limit in slow-body sockets; /healthz answered
    beside them, nothing lost, each socket cut with a 408 (its figures are the run's to report)."""
    run = slow_flood(App(url, os.getpid()), BODY_TIMEOUT_S, 4)
    assert run.held, run.summary()
    assert len(run.slow) == 3 * serve_limits(MAX_BATCH, MAX_WAITING)["max_ongoing_requests"]
