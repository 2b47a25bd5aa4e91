"""Routing to serving units through Ray Serve (tiny models, 127.0.0.1): two units (an ingress
replica each with its own target replica, the draft model in the ingress, prefix cache on). A
request's X-Session-Id keeps meeting one unit (X-Fly-Unit), so a conversation's second turn
finds its prefix cached; different ids spread over both units; no id still works; a unit that
drains gets no more sessions (deployments/routing/unit_router.py)."""

import time

import pytest
import requests
from serve_fixture import start_serve, stop_serve

from deployments.routing.unit_router import ROUTING_STATS_PERIOD_S, SESSION_HEADER
from loadtest.waits import until

pytestmark = pytest.mark.serve

APP = {
    "tiny": True,
    "units": 2,
    "drafter_placement": "ingress",
    "prefix_cache": True,
    "max_batch": 2,
    "defaults": {"max_tokens": 8},
}
SYSTEM = "You are a careful assistant who answers briefly. " * 8  # several full KV blocks


def healthz(url, session: str | None = None) -> requests.Response:
    headers = {SESSION_HEADER: session} if session else {}
    return requests.get(f"{url}/healthz", headers=headers, timeout=30)


def unit_of(r: requests.Response) -> int:
    return int(r.headers["X-Fly-Unit"])


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    deadline = time.monotonic() + 240
    ready: set[int] = set()
    i = 0
    while ready != {0, 1}:  # both units answer, and say so in their routing stats
        assert time.monotonic() < deadline, f"units ready: {ready}"
        r = healthz(base, f"probe-{i}")
        i += 1
        if r.status_code == 200:
            ready.add(unit_of(r))
        else:
            time.sleep(0.5)
    # the proxy's router has read every unit's "ready" once sessions spread over both and stay put
    # (its stats arrive every ROUTING_STATS_PERIOD_S, later on a loaded machine): bounded
    assert until(lambda: settled(base), 120), "sessions never settled over both units"
    yield base
    stop_serve()


def settled(url) -> bool | None:
    """True if 16 sessions meet both units, and the same ones twice, a few stats periods apart."""
    first = {s: unit_of(healthz(url, f"settle-{s}")) for s in range(16)}
    time.sleep(2 * ROUTING_STATS_PERIOD_S)
    again = {s: unit_of(healthz(url, f"settle-{s}")) for s in range(16)}
    return True if first == again and set(first.values()) == {0, 1} else None


def complete(url, prompt: str, session: str | None) -> requests.Response:
    headers = {SESSION_HEADER: session} if session else {}
    body = {"prompt": prompt, "max_tokens": 8, "fly": {"mode": "fly", "k": 4}}
    r = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_a_session_keeps_its_unit_and_its_second_turn_hits_the_cache(url):
    for s in range(4):
        session = f"chat-{s}"
        turn = f"{SYSTEM}\nUser {s}: name a colour.\nAssistant:"
        first = complete(url, turn, session)
        turn += first.json()["choices"][0]["text"] + "\nUser: and another?\nAssistant:"
        second = complete(url, turn, session)
        assert unit_of(first) == unit_of(second), session
        assert second.json()["fly"]["prefix_hit_tokens"] >= 16  # its unit's target held the conversation


def test_sessions_spread_over_both_units_and_keep_them(url):
    units = {}
    for s in range(24):
        seen = {unit_of(healthz(url, f"user-{s}")) for _ in range(3)}
        assert len(seen) == 1, (s, seen)  # every request of a session meets one unit
        units[s] = seen.pop()
    assert set(units.values()) == {0, 1}, units  # 24 ids all on one unit: 2 ** -23


def test_no_session_id_is_served_by_either_unit(url):
    seen = {unit_of(complete(url, "def add(a, b):", None)) for _ in range(2)}
    seen |= {unit_of(r) for r in (healthz(url) for _ in range(20)) if r.status_code == 200}
    assert seen == {0, 1}


def test_a_draining_unit_gets_no_more_sessions(url):
    """Last in the module: the unit stays drained."""
    from ray import serve

    session = "chat-to-drain"
    home = unit_of(healthz(url, session))
    # a handle call with the same session id meets the same unit (the rule is the router's)
    serve.get_deployment_handle("FlyIngress", "fly").options(session_id=session).drain.remote().result()
    deadline = time.monotonic() + max(60.0, 10 * ROUTING_STATS_PERIOD_S)  # the router's stats, on a loaded machine
    while (r := healthz(url, session)).status_code != 200:  # 503 "draining" until the router reads it
        assert r.json()["status"] == "draining" and unit_of(r) == home
        assert time.monotonic() < deadline, "the router kept sending the session to its draining unit"
        time.sleep(0.2)
    assert unit_of(r) != home
    assert unit_of(complete(url, "def add(a, b):", session)) != home
