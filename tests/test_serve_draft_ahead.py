"""Draft-ahead through Ray Serve on tiny models: the drafter pool's call for the next round and the
target replica's verify are in flight together, the drafter's guesses and its guessed tails
travel through the remote parts (remote_parts.py, row_history.py), and the outputs are the
sequential in-process engine's, greedy and seeded; the same with the drafter in the ingress, and
with both models there."""

import pytest
import requests
from serve_fixture import start_serve, stop_serve, wait_ready

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

APP = {"tiny": True, "tp_size": 1, "max_batch": 4, "draft_ahead": True, "defaults": {"max_tokens": 24}}
PROMPTS = ["def add(a, b):\n    return", "hello hello hello"]


@pytest.fixture(scope="module", params=[("replica", "replica"), ("ingress", "replica"), ("ingress", "ingress")])
def url(request):
    """(drafter, target) placements: the drafter pool (two remote calls in flight together), the
    drafter in the ingress (cpu-target-replica.yaml's shape: it drafts on the engine's drafter
    thread during the remote verify), and both models in the ingress (cpu-default.yaml's: the
    drafter thread drafts while the engine thread verifies, in one process)."""
    drafter, target = request.param
    base = start_serve({**APP, "drafter_placement": drafter, "target_placement": target})
    yield base
    stop_serve()


@pytest.mark.parametrize(
    "fly", [{"mode": "fly", "k": 4}, {"mode": "spd", "k": 3}, {"mode": "fly", "k": 5, "temperature": 0.9, "seed": 3}]
)
def test_served_draft_ahead_gives_the_sequential_engines_outputs(url, fly):
    wait_ready(url)
    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024)  # sequential, in process
    sampling = {k: fly.pop(k) for k in ("temperature", "seed") if k in fly}
    hits = misses = 0
    for prompt in PROMPTS:
        want = engine.generate([prompt], [{"max_tokens": 24, **fly, **sampling}])[0].text
        body = {"prompt": prompt, "max_tokens": 24, "fly": fly, **sampling}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        hits += r.json()["fly"]["ahead_hits"]
        misses += r.json()["fly"]["ahead_misses"]
    # the tiny pair repeats one token at T = 0 (every bet wins); at T = 0.9 bets are mostly lost
    assert (hits > 0) if not sampling else (misses > 0)
    stats = requests.get(f"{url}/v1/fly/stats", timeout=30).json()
    assert set(stats["timeline"]) >= {"ahead_call", "verify_wait", "draft_wait"}
