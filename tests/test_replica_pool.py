"""Sticky groups and the busy-time autoscaling policy (deployments/routing/replica_pool.py); the routing
through real Serve replicas is in test_serve_scaling.py."""

import pytest
from ray.serve.config import AutoscalingContext

from deployments.routing.replica_pool import (
    BUSY,
    BusyPolicy,
    desired_replicas,
    group_from_tag,
    group_of,
    group_tag,
    split,
)

KEYS = [f"cmpl-{i:04d}" for i in range(2000)]


def test_groups_are_stable_and_cover_every_group():
    for n in (1, 2, 3, 5):
        groups = [group_of(k, n) for k in KEYS]
        assert groups == [group_of(k, n) for k in KEYS]  # deterministic (not the salted hash())
        counts = [groups.count(g) for g in range(n)]
        assert min(counts) > 0.6 * len(KEYS) / n, counts  # roughly even


def test_growing_the_pool_moves_only_the_new_groups_share():
    for n in (1, 2, 3, 4):
        before = {k: group_of(k, n) for k in KEYS}
        after = {k: group_of(k, n + 1) for k in KEYS}
        moved = [k for k in KEYS if before[k] != after[k]]
        assert all(after[k] == n for k in moved)  # a key only ever moves to the new group
        assert 0.6 / (n + 1) < len(moved) / len(KEYS) < 1.4 / (n + 1)


def test_split_and_tags():
    groups = split(KEYS[:50], 3)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(50))
    assert all(group_of(KEYS[i], 3) == g for g, idx in groups.items() for i in idx)
    assert group_from_tag(group_tag(7)) == 7
    assert group_from_tag(None) is None and group_from_tag("") is None and group_from_tag("model-x") is None


def context(busy: dict | None, target_replicas: int = 1) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="FlyDrafter",
        app_name="fly",
        current_num_replicas=target_replicas,
        target_num_replicas=target_replicas,
        running_replicas=[],
        total_num_requests=1.0,
        total_queued_requests=0.0,
        aggregated_metrics={BUSY: busy} if busy is not None else {},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=None,
    )


def test_busy_policy():
    policy = BusyPolicy(target=0.5)
    assert policy(context({"r1": 0.9}))[0] == pytest.approx(1.8)  # one replica busy 90%: two wanted
    assert policy(context({"r1": 0.9, "r2": 0.9}, 2))[0] == pytest.approx(3.6)
    assert policy(context({"r1": 0.1, "r2": 0.05}, 2))[0] == 1.0  # never below one
    assert policy(context(None, 3))[0] == 3  # no reports yet: keep the current target
    assert desired_replicas([1.7, -0.2], 1.0) == 1.0  # fractions are clamped to [0, 1]
    with pytest.raises(ValueError, match="target"):
        BusyPolicy(target=0)


def test_rows_sharing_a_prefix_meet_the_same_drafter_within_a_bound_on_load():
    from deployments.parts.remote_parts import RemoteDrafter
    from deployments.routing.replica_pool import AFFINITY_TOKENS, pick_group, prefix_affinity, ranking
    from fly_serve.contracts import Row

    assert all(ranking(k, 3)[0] == group_of(k, 3) for k in KEYS[:100])
    system = list(range(AFFINITY_TOKENS))
    assert prefix_affinity(system + [1], "a") == prefix_affinity(system + [2, 3], "b")  # the prefix decides
    assert prefix_affinity([5, 6], "a") == "a"  # a short prompt: its own key
    # bounded loads: the preferred group while under ceil(1.5x the mean) + 1, then the next in its ranking
    first, second = ranking(prefix_affinity(system, "x"), 4)[:2]
    assert pick_group(prefix_affinity(system, "x"), 4, {}) == first
    assert pick_group(prefix_affinity(system, "x"), 4, {first: 2}) == first  # bound ceil(1.5 * 3 / 4) + 1 = 3
    assert pick_group(prefix_affinity(system, "x"), 4, {first: 4}) == second  # bound ceil(1.5 * 5 / 4) + 1 = 3

    drafter = RemoteDrafter(handle=None, max_groups=4, live=lambda: 4)
    rows = [Row(f"r{i}", system + [i]) for i in range(3)] + [
        Row(f"s{i}", [7] * (AFFINITY_TOKENS + i)) for i in range(3)
    ]
    groups = drafter.assign(rows)
    by_row = {i: g for g, idx in groups.items() for i in idx}
    assert len({by_row[i] for i in range(3)}) == 1 and len({by_row[i] for i in range(3, 6)}) == 1
    # a hot prefix spills over once its group holds more than its share
    many = [Row(f"h{i}", system + [100 + i]) for i in range(12)]
    hot = drafter.assign(many)
    assert max(len(idx) for idx in hot.values()) < 12 and len(hot) > 1
    assert drafter.assign(many) == hot  # pinned: the same groups next round


def test_the_live_replica_count_never_waits_for_serves_controller():
    """A round asks how many drafter replicas live; the answer comes from Serve's controller, which
    is gone while the head node is down: the round gets the last count at once, one refresh waits
    on a thread of its own, and its answer counts once it comes (tests/test_head_node_loss.py)."""
    import threading
    import time

    from deployments.routing.replica_pool import LiveReplicas

    gate, asked = threading.Event(), []

    def ask():  # a controller that answers only when let
        asked.append(time.monotonic())
        assert gate.wait(10)
        return 3

    live = LiveReplicas("fly", "FlyDrafter", ttl_s=0.0, ask=ask)
    t0 = time.monotonic()
    assert [live() for _ in range(50)] == [1] * 50  # the default until an answer came: no wait
    assert time.monotonic() - t0 < 5.0 and len(asked) <= 1  # not the 10 s the ask waits; one at a time
    deadline = time.monotonic() + 10  # the asking thread runs when scheduled
    while not asked:
        assert time.monotonic() < deadline, "the controller was never asked"
        time.sleep(0.01)
    assert [live() for _ in range(50)] == [1] * 50 and len(asked) == 1  # still the one ask, still waiting
    gate.set()
    deadline = time.monotonic() + 10
    while live() != 3:
        assert time.monotonic() < deadline, "the answer never counted"
        time.sleep(0.01)

    def broken():
        raise RuntimeError("controller gone")

    failing = LiveReplicas("fly", "FlyDrafter", ttl_s=0.0, ask=broken)
    failing._n = 2
    for _ in range(20):
        assert failing() == 2  # a failed ask keeps the last answer
        time.sleep(0.005)
