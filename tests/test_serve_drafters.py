"""Two drafters behind one target through Ray Serve (tiny models, 127.0.0.1): one of the target's
own tokenizer (tiny:1) and one of another family (tiny-sp:2, drafting through the vocabulary the
two share), each its own deployment and pool. Requests choosing each, and requests leaving the
choice to k auto, get the in-process target's own greedy text; an unknown drafter is a 400 that
names `fly.drafter`; /v1/fly/stats and each response's `fly` object say which drafter drafted
how many tokens and how many were kept; the openai client drives it as any OpenAI server."""

import openai
import pytest
import requests
from serve_fixture import running, start_serve, stop_serve, wait_ready

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

DRAFTERS = {"same": "tiny:1", "cross": {"model": "tiny-sp:2", "greedy": "string"}}
APP = {"target": "tiny:0", "drafter": None, "drafters": DRAFTERS, "tp_size": 1, "max_batch": 4}
PROMPTS = ["def add(a, b):\n    return", "the Queue is not None"]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


def target_text(prompt: str, max_tokens: int) -> str:
    """The target's own greedy text of a chat request, in process."""
    from fly_serve.engine.prompts import chat_prompt

    eng = build_engine("tiny:0", None, max_model_len=4096, progress=lambda _: None, calibrate=False)
    req = eng.generate([chat_prompt(eng.tokenizer, prompt)], dict(mode="ar", max_tokens=max_tokens))[0]
    return req.text


def test_requests_choose_each_drafter_and_get_the_targets_text(url):
    from ray import serve

    wait_ready(url)
    assert set(serve.status().applications["fly"].deployments) == {
        "FlyIngress",
        "FlyTarget",
        "FlyDrafter",
        "FlyDrafter-cross",
    }
    assert running("FlyDrafter") >= 1 and running("FlyDrafter-cross") >= 1
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for prompt in PROMPTS:
        want = target_text(prompt, 20)
        for fly in (
            {"mode": "spd", "k": 4, "drafter": "same"},
            {"mode": "spd", "k": 4, "drafter": "cross", "cross_vocab": "tli"},
            {"mode": "fly", "k": 5, "theta": 1.0, "drafter": "cross", "cross_vocab": "string"},
            {"mode": "spd", "k": "auto"},  # k auto picks per row among both drafters
        ):
            out = client.chat.completions.create(
                model="tiny:0",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=20,
                temperature=0,
                extra_body={"fly": fly},
            )
            assert out.choices[0].message.content == want, fly
            by = out.model_extra["fly"]["by_drafter"]
            if "drafter" in fly:
                assert set(by) <= {fly["drafter"]} and by.get(fly["drafter"], {}).get("drafted", 0) > 0
    stats = requests.get(f"{url}/v1/fly/stats", timeout=30).json()
    assert stats["drafters"] == ["same", "cross"]
    assert {"same", "cross"} <= set(stats["by_drafter"])
    assert all(0 <= c["kept"] <= c["drafted"] for c in stats["by_drafter"].values())
    assert set(stats["drafter_caches"]) == {"same", "cross"}
    assert stats["drafter_caches"]["cross"]["shared_tokens"] > 0  # the cross-family pool's map
    assert stats["drafter_caches"]["cross"]["drafted_by_method"]["tli"] > 0


def test_an_unknown_drafter_is_a_400_naming_the_field(url):
    wait_ready(url)
    body = {"prompt": "hello", "max_tokens": 4, "fly": {"drafter": "nope"}}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "fly.drafter" and "same, cross" in err["message"]
    long = {**body, "fly": {"drafter": "x" * 100_000}}  # echoed as a short prefix, not in full
    r = requests.post(f"{url}/v1/completions", json=long, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "fly.drafter" and len(r.text) < 1000, r.text[:300]
