"""The app through Ray Serve (tiny models, target TP=2 over gloo) against
the in-process engine: same outputs, batching, streaming, the OpenAI client, errors."""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from serve_fixture import start_serve, stop_serve

from fly_serve.build import build_engine
from fly_serve.contracts import Drafts, Row
from fly_serve.loading.loading import load_model, load_tokenizer
from fly_serve.runtime.model_scorer import ModelScorer
from fly_serve.runtime.runner import Runner

pytestmark = pytest.mark.serve

APP = {"tiny": True, "tp_size": 2, "max_batch": 8, "defaults": {"max_tokens": 24}}
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "1, 2, 3, 4, 5,", "hello hello hello"]
MODES = ["fly", "ar", "spd", "pld"]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


@pytest.fixture(scope="module")
def reference():
    """The in-process engine with the same tiny pair at TP=1; text for (prompt, params)."""
    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024)

    def run(prompt, **params):
        req = engine.generate([prompt], [{"max_tokens": 24, **params}])[0]
        return req.text, req.finish_reason

    return run


def complete(url, **body):
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", MODES)
def test_greedy_through_serve_equals_in_process(url, reference, mode):
    for prompt in PROMPTS:
        out = complete(url, prompt=prompt, max_tokens=24, fly={"mode": mode})
        choice = out["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == reference(prompt, max_tokens=24, mode=mode)
        assert out["usage"]["completion_tokens"] > 0
        assert out["fly"]["rounds"] >= 1


def test_concurrent_requests_are_batched_and_each_correct(url, reference):
    # ar decodes one token per round, so the 8 requests overlap for many rounds
    jobs = [(p, m) for p in PROMPTS for m in ("ar", "fly")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: complete(url, prompt=j[0], max_tokens=40, fly={"mode": j[1]}), jobs))
    for (prompt, mode), out in zip(jobs, outs):
        assert out["choices"][0]["text"] == reference(prompt, max_tokens=40, mode=mode)[0]
    assert max(o["fly"]["max_batch_size"] for o in outs) > 1
    assert len({o["choices"][0]["text"] for o in outs}) > 1  # really different sequences
    stats = requests.get(f"{url}/v1/fly/stats", timeout=30).json()
    assert stats["largest_batch"] > 1
    # every finished request is in the suffix index, which says what it holds
    suffix = stats["draft_sources"]["suffix"]
    assert suffix["sequences"] >= len(jobs) and 0 < suffix["tokens"] and suffix["bytes"] > 0


def sse_events(response):
    events = [line[len("data: ") :] for line in response.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("mode", ["fly", "ar"])
def test_stream_concatenates_to_the_full_text(url, mode):
    body = dict(prompt=PROMPTS[0], max_tokens=30, fly={"mode": mode})
    full = complete(url, **body)
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert reasons == [full["choices"][0]["finish_reason"]]
    assert chunks[-1]["usage"] == full["usage"] and chunks[-1]["fly"]["rounds"] == full["fly"]["rounds"]


def test_openai_client(url, reference):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    [model] = [m.id for m in client.models.list()]
    out = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=24, extra_body={"fly": {"mode": "fly", "k": 8, "window": 3}}
    )
    assert out.choices[0].text == reference(PROMPTS[1], max_tokens=24, mode="fly", k=8, window=3)[0]
    assert out.model_extra["fly"]["tau"] > 1

    messages = [{"role": "user", "content": "Write a haiku"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16)
    prompt = load_tokenizer("tiny:0").apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.choices[0].message.content == reference(prompt, max_tokens=16)[0]
    assert chat.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


BAD = [
    ({"prompt": "x", "fly": {"k": 0}}, "fly.k"),
    ({"prompt": "x", "fly": {"mode": "fast"}}, "fly.mode"),
    ({"prompt": "x", "fly": {"window": 20, "k": 10}}, "fly.window"),
    ({"prompt": "x", "fly": {"entropy": "cross"}}, "fly.entropy"),
    ({"prompt": "x", "fly": {"bogus": 1}}, "fly.bogus"),
    ({"prompt": "x", "fly": {"k": "many"}}, "fly.k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
]


def test_bad_fields_are_400_naming_the_field_and_leave_others_alone(url, reference):
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(complete, url, prompt=PROMPTS[2], max_tokens=40, fly={"mode": "ar"})
        for body, param in BAD:
            r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert (err["param"], err["type"], err["code"]) == (param, "invalid_request_error", None), body
            assert err["message"]
        assert good.result()["choices"][0]["text"] == reference(PROMPTS[2], max_tokens=40, mode="ar")[0]


def test_bad_requests_other_shapes(url):
    r = requests.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = requests.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = requests.post(f"{url}/v1/completions", json={"prompt": "x", "model": "gpt-9"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = requests.post(
        f"{url}/v1/completions", data="{not json", timeout=60, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def test_health_models_and_drafter_affinity(url):
    assert requests.get(f"{url}/healthz", timeout=30).json()["engine_loop"] is True
    assert requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny:0"
    complete(url, prompt=PROMPTS[3], max_tokens=40, fly={"mode": "fly", "k": 4, "window": 1})
    cache = requests.get(f"{url}/v1/fly/stats", timeout=30).json()["drafter_cache"]
    # one drafter replica: every round after a sequence's first finds its cache warm
    assert cache["hits"] > 0 and 0 < cache["hit_rate"] <= 1


def test_tp2_target_deployment_equals_tp1(url):
    from ray import serve

    handle = serve.get_deployment_handle("FlyTarget", app_name="fly")
    assert handle.report.remote().result().tp_size == 2
    rows = [
        Row("tp-a", [5, 17, 42, 99, 7, 3, 250, 11], k=3, entropy="topk"),
        Row("tp-b", [1, 2, 3], k=2, entropy="full"),
    ]
    drafts = Drafts([[4, 5, 6], [7, 8]], [None, None])
    got = handle.verify.remote(rows, drafts).result()
    ref = ModelScorer(Runner(load_model("tiny:0")), vocab_size=len(load_tokenizer("tiny:0"))).verify(rows, drafts)
    assert torch.equal(got.ok, ref.ok) and torch.equal(got.y, ref.y)
    assert torch.allclose(got.h, ref.h, atol=1e-5)
    handle.release.remote(["tp-a", "tp-b"]).result()


def test_prometheus_metrics_are_exported(url):
    """Ray's metrics agent serves the app's counters in Prometheus text format."""
    import re
    import time

    import ray

    complete(url, prompt=PROMPTS[2], max_tokens=20, fly={"mode": "fly", "k": 4, "window": 1})
    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = {
        "ray_fly_spec_decode_num_draft_tokens_total",
        "ray_fly_spec_decode_num_accepted_tokens_total",
        "ray_fly_round_phase_seconds_count",
        "ray_fly_batch_size_count",
    }
    found: set = set()
    for _ in range(30):  # the agent exports every few seconds
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found = set(re.findall(r"^(ray_fly_\w+)", text, re.M))
        if wanted <= found:
            break
        time.sleep(2)
    assert wanted <= found
    drafted = re.search(r"^ray_fly_spec_decode_num_draft_tokens_total\{.*\} ([0-9.e+]+)$", text, re.M)
    assert drafted and float(drafted.group(1)) > 0
