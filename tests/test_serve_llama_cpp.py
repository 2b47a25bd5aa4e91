"""The served CPU default's runtime, llama.cpp, through Ray Serve and real HTTP on 127.0.0.1: the
tiny pair written as GGUF files (fly_serve/loading/tiny_gguf.py) in cpu-default's composition
(both models inside the ingress process), `runtime: llama.cpp`. The ingress process runs
llama.cpp's library (read from its memory map), and what it answers is what the in-process engine
on the same files gives: plain, speculative, strict FLy, streamed (paced) and not, and through the
openai client. (Tiny models pick torch under runtime auto, so without this no Serve test would run it.)"""

import json
import time

import openai
import pytest
import requests
from serve_fixture import start_serve, stop_serve

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

STREAM_INTERVAL_S = 0.5  # streams paced, as the CPU profiles' (0.2 s there)
APP = {
    "tiny": True,
    "runtime": "llama.cpp",
    "tp_size": 1,
    "target_placement": "ingress",
    "drafter_placement": "ingress",
    "max_batch": 4,
    "defaults": {"max_tokens": 16},
    "stream_interval_s": STREAM_INTERVAL_S,
}
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "1, 2, 3, 4, 5,"]
# fixed k: one request alone then runs the same rounds streamed or not, here and in process
MODES = [{"mode": "ar"}, {"mode": "spd", "k": 4}, {"mode": "fly", "k": 4, "theta": 1.0}]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


@pytest.fixture(scope="module")
def reference():
    engine = build_engine("tiny:0", "tiny:1", runtime="llama.cpp", max_batch=1, max_model_len=1024)

    def run(prompt, params):
        return engine.generate([prompt], [{"max_tokens": 16, **params}])[0].text

    return run


def ingress_maps() -> str:
    """The ingress replica's memory map: which native libraries that process has loaded."""
    from ray._private import state

    [pid] = [a["Pid"] for a in state.actors(actor_state_name="ALIVE").values() if "FlyIngress" in a["ActorClassName"]]
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_ingress_runs_both_models_on_llama_cpp(url):
    assert requests.get(f"{url}/healthz", timeout=30).status_code == 200
    assert "libllama" in ingress_maps()


@pytest.mark.parametrize("params", MODES, ids=lambda p: p["mode"])
def test_greedy_through_serve_is_the_in_process_engines_text_on_the_same_gguf_files(url, reference, params):
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 16, "fly": params}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        want = reference(prompt, params)
        assert r.json()["choices"][0]["text"] == want
        streamed = ""
        with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as s:
            assert s.status_code == 200
            for line in s.iter_lines(decode_unicode=True):
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == want


def test_the_openai_client_chats_with_it(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        extra_body={"fly": {"mode": "fly", "k": 4, "theta": 1.0}},
    )
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens > 0
    assert out.model_extra["fly"]["rounds"] >= 1


def test_a_stream_is_paced_and_arrives_whole(url, reference):
    """At most a chunk every stream_interval_s besides the first and the last (deployments/ingress/
    stream_pacing.py; the first at once: tests/test_stream_pacing.py), the text as unstreamed and the
    usage on the last chunk."""
    body = {"prompt": PROMPTS[2], "max_tokens": 48, "fly": {"mode": "ar"}}
    full = requests.post(f"{url}/v1/completions", json=body, timeout=120).json()
    want, n = full["choices"][0]["text"], full["usage"]["completion_tokens"]
    assert want == reference(PROMPTS[2], {"mode": "ar", "max_tokens": 48}) and n >= 24  # a long stream
    t0, texts, last = time.monotonic(), [], None
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                texts.append(last["choices"][0]["text"])
    elapsed = time.monotonic() - t0
    assert "".join(texts) == want and last["usage"]["completion_tokens"] == n
    assert len(texts) <= 2 + elapsed / STREAM_INTERVAL_S  # the first, the paced ones, the end
    assert len(texts) < n  # a chunk a round would be one a token
