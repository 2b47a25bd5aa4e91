"""A drafter replica on llama.cpp drafting for two serving units at once (issue 54), over HTTP on
127.0.0.1: tiny models as GGUF on the llama.cpp runtime, two ingress units of max_batch 1 and one
drafter replica. Its sequence ids were max_batch (1 here), so the two units' rows took turns
evicting each other, and every drafting call prefilled its row again; the health probe fed a
sequence of its own and evicted a row too. Now every row keeps its cells: one cold call per
request, no eviction, whatever the probe does meanwhile."""

import json
import threading
import time

import pytest
import requests
from serve_fixture import per_replica, start_serve, stop_serve

pytestmark = pytest.mark.serve

APP = {
    "tiny": True,
    "runtime": "llama.cpp",
    "units": 2,
    "max_batch": 1,
    "max_waiting": 8,
    "max_model_len": 1024,
    "prefix_cache": False,
    "target_placement": "ingress",
    "drafter_placement": "replica",
    "defaults": {"mode": "fly", "k": 3, "window": 1},
}
STREAMS = 6  # sessions: their rendezvous spreads them over both units
TOKENS = 160
TIMEOUT = 120


@pytest.fixture(scope="module")
def url():
    yield start_serve(APP)
    stop_serve()


def stats(url: str) -> dict:
    return requests.get(f"{url}/v1/fly/stats", timeout=TIMEOUT).json()


def stream(url: str, session: str, out: dict) -> None:
    body = {"prompt": f"{session}: def fib(n):", "max_tokens": TOKENS, "stream": True}
    headers = {"X-Session-Id": session}
    with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=TIMEOUT) as r:
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
        out[session] = (r.status_code, r.headers.get("X-Fly-Unit"), lines)


def streams_at_once(url: str, batch: int) -> dict:
    """STREAMS streams at once, the drafter replica's health probe called while they run."""
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(url, f"b{batch}s{i}", out)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(3):  # the drafter replica's health probe, while rows are held
        assert per_replica("FlyDrafter", "healthy", 1) == [True]
    for t in threads:
        t.join(TIMEOUT)
    assert len(out) == STREAMS and all(status == 200 for status, _, _ in out.values()), out
    for _, _, lines in out.values():
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: ") :])["usage"]["completion_tokens"] == TOKENS
    return out


def test_two_units_rows_keep_their_drafter_cache_through_the_probe(url):
    before = stats(url)["drafter_cache"]
    units, sent = set(), 0
    for batch in range(5):  # until both units drafted at once (a unit still loading is passed over)
        out = streams_at_once(url, batch)
        units |= {unit for _, unit, _ in out.values()}
        sent += STREAMS
        if len(units) == 2:
            break
        time.sleep(2)
    assert len(units) == 2, units
    after = stats(url)["drafter_cache"]
    # each request's rows met the replica cold once (its first drafting call), never again
    assert after["misses"] - before["misses"] <= sent, (before, after)
    assert after["hits"] - before["hits"] > sent, (before, after)
    assert after["evicted"] == before["evicted"] == 0, after
