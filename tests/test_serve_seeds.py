"""A seeded request repeats under the served default (issue 54, item 4): through real HTTP on one
small app shaped like cpu-default.yaml (both tiny models in the ingress, fly with k "auto" and
theta 1, the prefix cache on), the same chat request at temperature 1 with a seed gives one text,
sent alone and beside other requests, and whatever mode it asks for. Every sampled draw is keyed
by (seed, position) and drafter and target share the numbers (fly_serve/decision/sampling.py), so
the committed text is the target's own draw whatever k "auto" chose under the load."""

import threading

import pytest
import requests
from serve_fixture import start_serve, stop_serve, wait_ready

pytestmark = pytest.mark.serve

APP = {
    "tiny": True,
    "max_batch": 4,
    "target_placement": "ingress",
    "drafter_placement": "ingress",
    "prefix_cache": True,
    "defaults": {"mode": "fly", "k": "auto", "k_max": 15, "theta": 1.0, "window": 6, "max_tokens": 48},
}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to ten in words."}]
SEEDED = {"messages": MESSAGES, "temperature": 1.0, "seed": 1234, "max_tokens": 48}
LOAD = [  # what runs beside it: other prompts, modes and sampling
    {"messages": [{"role": "user", "content": "Say something long."}], "max_tokens": 80},
    {"messages": [{"role": "user", "content": "abc abc abc abc"}], "max_tokens": 80, "fly": {"mode": "spd", "k": 6}},
    {"messages": MESSAGES, "max_tokens": 80, "temperature": 0.8, "seed": 7},
]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    wait_ready(base)
    yield base
    stop_serve()


def chat(url: str, body: dict) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def beside_load(url: str, body: dict) -> dict:
    """body sent while the LOAD requests run (started first, so it joins a busy batch)."""
    others = [threading.Thread(target=chat, args=(url, b)) for b in LOAD]
    for t in others:
        t.start()
    try:
        return chat(url, body)
    finally:
        for t in others:
            t.join(timeout=120)


def test_a_seeded_request_gives_one_text_alone_and_beside_load(url):
    alone = [chat(url, SEEDED) for _ in range(3)]
    loaded = [beside_load(url, SEEDED) for _ in range(3)]
    texts = {text(a) for a in alone + loaded}
    assert len(texts) == 1, texts
    assert alone[0]["usage"]["completion_tokens"] == 48


@pytest.mark.parametrize(
    "fly", [{"mode": "ar"}, {"mode": "pld", "k": 4}, {"mode": "spd", "k": 4}, {"mode": "fly", "k": 8, "theta": 1.0}]
)
def test_a_seeded_request_gives_the_same_text_in_every_strict_mode(url, fly):
    answer = chat(url, {**SEEDED, "fly": fly})
    assert text(answer) == text(chat(url, SEEDED))
    if fly["mode"] in ("spd", "fly"):
        assert answer["fly"]["drafted"] > 0  # drafts were verified, and the text is still the target's draw


def test_another_seed_gives_another_text(url):
    assert text(chat(url, {**SEEDED, "seed": 4321})) != text(chat(url, SEEDED))
