"""Structured output through the OpenAI API (tiny random models, a local Ray + Serve): both
routes, json_object and json_schema, the `fly` regex and grammar, streaming, the openai client,
and a schema the grammar library refuses as a 400 naming `response_format`."""

import json
import re

import jsonschema
import openai
import pytest
import requests
from serve_fixture import start_serve, stop_serve

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

APP = {"tiny": True, "max_batch": 8, "defaults": {"max_tokens": 24}}
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["color", "n", "tags"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


def post(url, route, **body):
    return requests.post(f"{url}/v1/{route}", json=body, timeout=120)


@pytest.mark.parametrize(
    "fly", [{"mode": "fly", "k": 4}, {"mode": "spd", "k": "auto"}, {"mode": "ar"}, {"mode": "pld", "k": 3}]
)
def test_json_schema_on_both_routes(url, fly):
    chat = post(url, "chat/completions", messages=MESSAGES, response_format=RF, max_tokens=100, fly=fly)
    comp = post(url, "completions", prompt="{", response_format=RF, max_tokens=100, temperature=0.8, seed=3, fly=fly)
    for r, text in ((chat, lambda b: b["message"]["content"]), (comp, lambda b: b["text"])):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        jsonschema.validate(json.loads(text(choice)), SCHEMA)
        assert choice["finish_reason"] == "stop"


def test_json_object_streamed_and_through_the_openai_client(url):
    with requests.post(
        f"{url}/v1/completions",
        json={"prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 300, "stream": True},
        stream=True,
        timeout=120,
    ) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line[6:] not in ("", "[DONE]")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.startswith("{")
    if chunks[-1]["choices"][0]["finish_reason"] == "stop":  # a random model may nest past max_tokens
        assert isinstance(json.loads(text), dict)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.chat.completions.create(model="tiny:0", messages=MESSAGES, response_format=RF, max_tokens=100)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("fly", [{"mode": "spd", "k": 4}, {"mode": "fly", "k": 5, "theta": 0.0, "window": 1}])
def test_the_drafter_replica_drafts_under_the_grammar(url, fly):
    """APP's drafter is a replica (drafter_placement "replica"): it gets a constrained row's
    grammar with the row's first call and drafts under it, so a greedy request gives the
    in-process engine's tokens and the engine cuts none of its drafts."""
    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024)
    want = engine.generate(["{"], [{"max_tokens": 100, "response_format": RF, **fly}])[0]
    r = post(url, "completions", prompt="{", response_format=RF, max_tokens=100, temperature=0.0, fly=fly)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want.text and want.stats.grammar_cut == 0
    assert body["fly"]["grammar_cut"] == 0 and body["fly"]["drafted"] > 0


def test_regex_and_grammar_in_the_fly_object(url):
    r = post(url, "completions", prompt="id:", max_tokens=30, fly={"mode": "fly", "k": 3, "regex": "[a-f]{4}-[0-9]{3}"})
    assert r.status_code == 200 and re.fullmatch("[a-f]{4}-[0-9]{3}", r.json()["choices"][0]["text"])
    r = post(url, "chat/completions", messages=MESSAGES, max_tokens=30, fly={"grammar": 'start: "yes" | "no"'})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"fly": {"regex": "(a"}}, "fly.regex"),
        ({"fly": {"grammar": "start: undefined_rule"}}, "fly.grammar"),
    ],
)
def test_a_refused_format_is_a_400_naming_the_field(url, body, param):
    for route, head in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": MESSAGES})):
        r = post(url, route, **head, **body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
