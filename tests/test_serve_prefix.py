"""The prefix cache through Ray Serve (tiny models, target TP=2 over gloo, drafter replica): a
second request sharing a long prefix with the first reports prefix hit tokens (target and
drafter) in its `fly` stats and in /metrics, and its text equals the cache-less engine's."""

import re
import time

import pytest
import requests
from serve_fixture import start_serve, stop_serve

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

APP = {"tiny": True, "tp_size": 2, "max_batch": 4, "prefix_cache": True, "defaults": {"max_tokens": 16}}
PREFIX = "You are a careful assistant. " * 12


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


def complete(url, prompt: str) -> dict:
    body = dict(prompt=prompt, max_tokens=16, fly={"mode": "fly", "k": 4})
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_second_request_with_the_same_prefix_hits_the_cache(url):
    import ray

    reference = build_engine("tiny:0", "tiny:1", max_model_len=1024, calibrate=False)  # no prefix cache
    first, second = complete(url, PREFIX + "First:"), complete(url, PREFIX + "Second:")
    assert first["fly"]["prefix_hit_tokens"] == 0
    assert second["fly"]["prefix_hit_tokens"] >= 16 and second["fly"]["draft_prefix_hit_tokens"] >= 16
    for out, prompt in ((first, PREFIX + "First:"), (second, PREFIX + "Second:")):
        want = reference.generate([prompt], [dict(max_tokens=16, mode="fly", k=4)])[0].text
        assert out["choices"][0]["text"] == want

    port = ray.nodes()[0]["MetricsExportPort"]
    hits = {}
    for _ in range(30):  # the agent exports every few seconds
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        hits = {
            part: float(v)
            for part, v in re.findall(r'^ray_fly_prefix_cache_hits_total\{.*part="(\w+)".*\} ([0-9.e+]+)$', text, re.M)
        }
        if hits.get("target", 0) > 0 and hits.get("drafter", 0) > 0:
            break
        time.sleep(2)
    assert hits.get("target", 0) >= 16 and hits.get("drafter", 0) >= 16, hits
    queries = re.search(r"^ray_fly_prefix_cache_queries_total\{.*\} ([0-9.e+]+)$", text, re.M)
    assert queries and float(queries.group(1)) > hits["target"]
