"""The CPU topologies through Ray Serve on tiny models: the draft model in the ingress process
(drafter_placement: ingress) and the TP = 1 target in a replica of its own
(cpu-target-replica.yaml's shape) or in the ingress too (target_placement: ingress,
cpu-default.yaml's) give the in-process engine's outputs, with no deployment but those."""

import pytest
import requests
from serve_fixture import start_serve, stop_serve, wait_ready

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

APP = {"tiny": True, "tp_size": 1, "drafter_placement": "ingress", "max_batch": 4, "defaults": {"max_tokens": 24}}
PROMPTS = ["def add(a, b):\n    return", "hello hello hello"]


DEPLOYMENTS = {"replica": {"FlyIngress", "FlyTarget"}, "ingress": {"FlyIngress"}}


@pytest.fixture(scope="module", params=["replica", "ingress"])
def served(request):
    """(where the target is, the app's URL)."""
    base = start_serve({**APP, "target_placement": request.param})
    yield request.param, base
    stop_serve()


def k_auto_chat(content: str, max_tokens: int) -> dict:
    """A greedy chat request with k auto (strict verification)."""
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "fly": {"mode": "fly", "k": "auto", "theta": 1.0},
    }


def post_ok(url: str, path: str, body: dict) -> dict:
    r = requests.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", ["fly", "spd", "ar"])
def test_drafter_in_the_ingress_gives_the_engines_outputs(served, mode):
    from ray import serve

    placement, url = served
    wait_ready(url)
    assert set(serve.status().applications["fly"].deployments) == DEPLOYMENTS[placement]
    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024)
    fly = {"mode": mode, "k": 4}
    for prompt in PROMPTS:
        want = engine.generate([prompt], [{"max_tokens": 24, **fly}])[0].text
        r = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "fly": fly}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    stats = requests.get(f"{url}/v1/fly/stats", timeout=30).json()
    assert set(stats["timeline"]) >= {"ingress_wait", "draft_call", "draft_compute", "verify_call", "verify_compute"}
    if mode != "ar":
        assert stats["drafter_cache"]["forwards"] > 0  # the ingress's own draft model drafted


def test_a_greedy_request_repeated_alone_gets_one_text_plain_or_streamed(served):
    """k auto plans from the frozen cost profile and the row's own history, never from the clock:
    the same greedy request sent alone, three times plain and once streamed, gets the same ks
    round by round (so the same rounds and drafts) and one text (issue 19's served default)."""
    import json

    _, url = served
    wait_ready(url)
    body = k_auto_chat("count: one two three four", 40)
    plain = [post_ok(url, "/v1/chat/completions", body) for _ in range(3)]
    with requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [x[len("data: ") :] for x in r.iter_lines(decode_unicode=True) if x]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    texts = {o["choices"][0]["message"]["content"] for o in plain} | {streamed}
    assert len(texts) == 1 and texts != {""}
    plans = {(o["fly"]["rounds"], o["fly"]["drafted"], o["fly"]["accepted"]) for o in plain}
    plans.add((chunks[-1]["fly"]["rounds"], chunks[-1]["fly"]["drafted"], chunks[-1]["fly"]["accepted"]))
    assert len(plans) == 1, plans
    assert plain[0]["fly"]["drafted"] > 0  # k auto drafted (its probes at least): the plans were really compared


def test_rounds_under_load_refit_k_auto_and_a_request_alone_keeps_its_text(served):
    """Rounds of several rows are measured into k auto's model under load (its refits and drafter
    ratio in /v1/fly/stats); the same greedy k auto request alone before and after that load gets
    the same plan and text (a row alone is planned from the frozen profile only)."""
    from concurrent.futures import ThreadPoolExecutor

    _, url = served
    wait_ready(url)
    alone = k_auto_chat("list: red green blue", 32)
    before = post_ok(url, "/v1/chat/completions", alone)
    under = requests.get(f"{url}/v1/fly/stats", timeout=30).json()["k_auto_under_load"]
    load = [
        {"prompt": f"{p} {i}", "max_tokens": 48, "temperature": 0, "fly": {"mode": "fly", "k": 4, "theta": 1.0}}
        for i, p in enumerate(PROMPTS * 3)
    ]
    with ThreadPoolExecutor(len(load)) as pool:
        done = list(pool.map(lambda body: post_ok(url, "/v1/completions", body), load))
    stats = requests.get(f"{url}/v1/fly/stats", timeout=30).json()
    assert stats["largest_batch"] >= 2
    after_load = stats["k_auto_under_load"]
    assert after_load["rounds"] > under["rounds"] and after_load["refits"] > under["refits"]
    assert after_load["draft_ratio"] > 0
    assert all(d["usage"]["completion_tokens"] > 0 for d in done)
    after = post_ok(url, "/v1/chat/completions", alone)
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
    assert (after["fly"]["rounds"], after["fly"]["drafted"]) == (before["fly"]["rounds"], before["fly"]["drafted"])
