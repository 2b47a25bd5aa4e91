"""The CPU topology option (deployments/cpu-default.yaml's shape) through Ray Serve on tiny models:
a TP = 1 target and the draft model in the ingress process (drafter_placement: ingress) give
the in-process engine's outputs, with no drafter deployment."""

import pytest
import requests
from serve_fixture import start_serve, stop_serve

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

APP = {"tiny": True, "tp_size": 1, "drafter_placement": "ingress", "max_batch": 4, "defaults": {"max_tokens": 24}}
PROMPTS = ["def add(a, b):\n    return", "hello hello hello"]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


def wait_ready(url: str) -> None:
    import time

    deadline = time.monotonic() + 180
    while requests.get(f"{url}/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "not ready"
        time.sleep(0.5)


@pytest.mark.parametrize("mode", ["fly", "spd", "ar"])
def test_drafter_in_the_ingress_gives_the_engines_outputs(url, mode):
    from ray import serve

    wait_ready(url)
    assert set(serve.status().applications["fly"].deployments) == {"FlyIngress", "FlyTarget"}
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
