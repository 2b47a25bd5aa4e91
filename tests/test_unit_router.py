"""The choice of serving unit for an HTTP request (deployments/routing/unit_router.route): a session id
keeps meeting one unit within a bound on load, units that are not ready are passed over, units
coming and going move only their share of sessions; without a session id, two random units.
Through real Serve replicas: test_serve_units.py."""

import random
from collections import Counter

from deployments.routing.replica_pool import rendezvous
from deployments.routing.unit_router import Unit, route, units_from

SESSIONS = [f"conversation-{i}" for i in range(3000)]


def idle(*names: str) -> dict[str, Unit]:
    return {n: Unit(load=0, ready=True) for n in names}


def first(session: str, units: dict[str, Unit]) -> str:
    ranks = route(session, units)
    assert all(len(rank) == 1 for rank in ranks)  # one unit a rank: Serve tries them in order
    assert sorted(r[0] for r in ranks) == sorted(n for n, u in units.items() if u.ready)  # each once
    return ranks[0][0]


def test_a_session_keeps_its_unit_and_sessions_spread_evenly():
    units = idle("a", "b", "c")
    picks = {s: first(s, units) for s in SESSIONS}
    assert picks == {s: first(s, dict(reversed(units.items()))) for s in SESSIONS}  # not by order
    counts = Counter(picks.values())
    assert min(counts.values()) > 0.8 * len(SESSIONS) / 3, counts
    assert all(picks[s] == rendezvous(s, ["a", "b", "c"])[0] for s in SESSIONS)  # the drafter pool's rule


def test_bounded_load_spills_to_the_next_unit_in_the_sessions_order():
    order = rendezvous("chat-1", ["a", "b"])
    home, other = order
    # bound: ceil(1.5 x (total + 1) / units) + 1
    assert first("chat-1", {home: Unit(3, True), other: Unit(1, True)}) == home  # 3 < ceil(1.5 * 5 / 2) + 1 = 5
    assert first("chat-1", {home: Unit(6, True), other: Unit(0, True)}) == home  # 6 < ceil(1.5 * 7 / 2) + 1 = 7
    assert first("chat-1", {home: Unit(7, True), other: Unit(0, True)}) == other  # 7 >= ceil(1.5 * 8 / 2) + 1 = 7
    assert first("chat-1", {home: Unit(7, True), other: Unit(7, True)}) == home  # both busy: home again
    assert route("chat-1", {home: Unit(7, True), other: Unit(0, True)}) == [[other], [home]]  # home still a fallback


def test_units_that_are_not_ready_are_passed_over_while_one_is():
    units = idle("a", "b", "c") | {"b": Unit(0, ready=False)}
    assert all(first(s, units) != "b" for s in SESSIONS[:300])
    assert all(set(route("", units)[0]) == {"a", "c"} for _ in range(20))
    none_ready = {n: Unit(0, False) for n in "ab"}  # all loading: they answer their own 503
    assert {route(s, none_ready)[0][0] for s in SESSIONS[:100]} == {"a", "b"}
    assert route("s", {}) == [] and route("", {}) == []


def test_a_unit_that_has_not_reported_is_not_ready_and_a_stale_load_is_the_mean():
    ready, loading = {"status": "ready"}, {"status": "loading"}
    seen = {"a": (4, ready), "b": (None, ready), "c": (2, {}), "d": (0, loading)}
    units = units_from(seen)
    assert units == {"a": Unit(4, True), "b": Unit(2, True), "c": Unit(2, False), "d": Unit(0, False)}
    assert all(first(s, units) in {"a", "b"} for s in SESSIONS[:200])  # the new unit c waits for its report
    assert units_from({"a": (None, {"status": "ready"})}) == {"a": Unit(0, True)}


def test_units_coming_and_going_move_only_their_share():
    two, three = idle("a", "b"), idle("a", "b", "c")
    before = {s: first(s, two) for s in SESSIONS}
    after = {s: first(s, three) for s in SESSIONS}
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == "c" for s in moved)  # a new unit takes sessions, none moves between old ones
    assert 0.8 / 3 < len(moved) / len(SESSIONS) < 1.2 / 3
    gone = {s: first(s, idle("a", "c")) for s in SESSIONS}  # b leaves: only its sessions move
    assert all(gone[s] == after[s] for s in SESSIONS if after[s] != "b")


def test_no_session_is_the_less_loaded_of_two_random_units():
    rng = random.Random(0)
    ranks = [route("", idle("a", "b", "c"), rng=rng) for _ in range(300)]
    assert all(len(r) == 1 and len(set(r[0])) == 2 for r in ranks)  # one rank of two: Serve takes the less loaded
    assert Counter(n for r in ranks for n in r[0]).keys() == {"a", "b", "c"}
    assert route("", idle("a"), rng=rng) == [["a"]]
