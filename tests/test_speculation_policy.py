"""k: auto -- acceptance per row, the round cost profile, the allocation against brute force, the
policy's probes and cost check on fake cost functions (no speed asserted)."""

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import yaml

from fly_serve.k_auto.acceptance import AcceptanceTracker, expected_emitted
from fly_serve.k_auto.allocator import RowInfo, min_confidence_for, plan
from fly_serve.k_auto.cost_calibration import batch_shapes, verify_points
from fly_serve.k_auto.measured_cost import CostCheck, UnderLoad, point_of, width_price
from fly_serve.k_auto.round_cost import MODEL, NONE, PLD, BatchVerify, CostProfile, RoundCostModel
from fly_serve.k_auto.speculation_policy import RoundTrace, SpeculationPolicy, free_key


def cost_model(verify_at_1=0.02, per_token=0.0, per_forward=0.0, per_row_forward=0.0, per_round=0.0):
    """A linear verify (seconds at one token, plus per extra token) and the draft coefficients."""
    return RoundCostModel(
        {
            "verify": {"tokens": [1, 101], "seconds": [verify_at_1, verify_at_1 + 100 * per_token]},
            "draft": {"per_round": per_round, "per_forward": per_forward, "per_row_forward": per_row_forward},
        }
    )


def flat_profile(verify_s=0.1, per_token=0.0, per_forward=0.0, per_row_forward=0.0, per_round=0.0) -> CostProfile:
    return CostProfile([1, 101], [verify_s, verify_s + 100 * per_token], per_round, per_forward, per_row_forward)


def rate(ks, rows, cost, overlap=False) -> float:
    return sum(expected_emitted(k, r.acceptance) for k, r in zip(ks, rows)) / cost.round_s(ks, rows, overlap=overlap)


def brute_force(rows, cost, overlap=False) -> float:
    caps = [0 if r.source == NONE else r.limit for r in rows]
    choices = [[cap] if r.fixed else range(cap + 1) for cap, r in zip(caps, rows)]
    return max(rate(ks, rows, cost, overlap) for ks in itertools.product(*choices))


# ---- expected_emitted
def test_expected_emitted_closed_form():
    for a in (0.0, 0.2, 0.5, 0.9, 1 - 1e-12, 1.0):
        for k in range(21):
            assert expected_emitted(k, a) == pytest.approx(sum(a**i for i in range(k + 1)), rel=1e-9)
    ks, a = np.arange(10), np.linspace(0, 1, 10)
    assert np.allclose(expected_emitted(ks, a), [expected_emitted(k, x) for k, x in zip(ks, a)])


def test_expected_emitted_simulation():
    rng = np.random.default_rng(0)
    for a, k in ((0.7, 6), (0.95, 15), (0.3, 3)):
        kept = np.minimum(rng.geometric(1 - a, size=200_000) - 1, k)  # drafts passed before the first rejection
        assert (kept + 1).mean() == pytest.approx(expected_emitted(k, a), rel=0.01)


# ---- AcceptanceTracker
def simulate_round(rng, a, k):
    """(drafted, kept) of one round of k drafts at per-token acceptance a."""
    return k, int(min(rng.geometric(1 - a) - 1, k))


def test_tracker_converges_to_true_acceptance():
    rng = np.random.default_rng(1)
    tracker = AcceptanceTracker()
    truth = {"high": 0.85, "low": 0.35}
    history = {key: [] for key in truth}
    for _ in range(400):
        keys = list(truth)
        rounds = [simulate_round(rng, truth[key], 8) for key in keys]
        tracker.observe_round(keys, [n for n, _ in rounds], [m for _, m in rounds])
        for key in keys:
            history[key].append(tracker.estimate(key))
    for key, a in truth.items():
        assert np.mean(history[key][100:]) == pytest.approx(a, abs=0.03)
        assert 0 <= min(history[key]) and max(history[key]) < 1
    # Without forgetting, the estimate is the geometric MLE: kept / (kept + rejections).
    slow = AcceptanceTracker(prior_weight=1e-9, decay=1.0)
    for _ in range(3000):
        slow.observe("x", *simulate_round(rng, 0.6, 5))
    assert slow.estimate("x") == pytest.approx(0.6, abs=0.015)


def test_tracker_counts_a_truncated_round_as_one_rejection():
    tracker = AcceptanceTracker(prior_weight=1e-9, decay=1.0)
    tracker.observe("x", drafted=4, kept=4)  # ran out of drafts: 4 kept, no rejection
    tracker.observe("x", drafted=4, kept=2)  # 2 kept, then one rejection; the rest were never tried
    assert tracker.estimate("x") == pytest.approx(6 / 7)


def test_tracker_prior_forget_and_drift_back():
    """A row's estimate reads only its own rounds and the constant prior: other rows' rounds never
    move it (so a request alone is planned the same whatever ran before it)."""
    tracker = AcceptanceTracker(prior=0.5)
    assert tracker.estimate("new") == pytest.approx(0.5)
    rng = np.random.default_rng(2)
    for _ in range(50):
        rounds = [simulate_round(rng, 0.9, 10), simulate_round(rng, 0.9, 10), simulate_round(rng, 0.1, 10)]
        tracker.observe_round(["a", "b", "bad"], [n for n, _ in rounds], [m for _, m in rounds])
    assert tracker.estimate("never seen") == pytest.approx(0.5)
    assert tracker.estimate("a") > 0.8 and tracker.estimate("bad") < 0.3
    assert "never seen" not in tracker.rows  # an estimate keeps nothing
    # The bad row is left at k = 0: its evidence ages and it drifts back to the prior.
    for _ in range(60):
        tracker.observe_round(["a", "bad"], [10, 0], [9, 0])
    assert tracker.estimate("bad") == pytest.approx(0.5, abs=0.05)
    tracker.forget("a")
    tracker.forget("missing")
    assert set(tracker.rows) == {"b", "bad"}


def test_tracker_tokens_per_forward():
    tracker = AcceptanceTracker()
    assert tracker.tokens_per_forward("x") == 1.0
    for _ in range(30):
        tracker.observe("x", drafted=12, kept=6, forwards=4)
    assert tracker.tokens_per_forward("x") == pytest.approx(3.0, rel=0.05)


# ---- CostProfile and RoundCostModel
def test_profile_dict_round_trip_and_the_measured_draft_form():
    profile = CostProfile([1, 32, 256], [0.01, 0.011, 0.05], 0.001, 0.004, 0.0005, 0.002, "test")
    again = CostProfile.from_dict(yaml.safe_load(yaml.safe_dump(profile.to_dict())))
    assert again == profile and again.to_dict() == profile.to_dict()
    n = np.array([0.5, 1, 7, 32, 100, 256, 300, 5000])
    assert np.allclose(RoundCostModel(again).verify_s(n), RoundCostModel(profile).verify_s(n), rtol=1e-12)
    # tune-k's older form: seconds per drafter forward by rows in it, fitted as c + d * rows
    measured = CostProfile.from_dict(
        {
            "verify": {"tokens": [1, 2], "seconds": [0.1, 0.2]},
            "draft": {"rows": [1, 2, 4, 8], "seconds": [0.0045, 0.005, 0.006, 0.008]},
        }
    )
    assert RoundCostModel(measured).draft_coefficients == pytest.approx([0.0, 0.004, 0.0005])
    assert CostProfile.coerce(None).source == "default shape"
    with pytest.raises(ValueError, match="two or more"):
        CostProfile([1, 1], [0.1, 0.2])


def test_the_cost_model_is_frozen():
    """No method learns from round times: the same rows get the same plan after any rounds."""
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_forward=0.01))
    rows = [RowInfo("a", 8, acceptance=0.8), RowInfo("b", 8, acceptance=0.5)]
    before = policy.choose(rows), policy.cost.verify_s(np.arange(1, 40))
    rng = np.random.default_rng(0)
    for _ in range(30):  # noisy rounds at one operating point, within the check's tolerance
        policy.record(
            RoundTrace(
                ["a", "b"],
                [8, 8],
                [4, 2],
                kinds=[MODEL, MODEL],
                draft_s=0.08 * rng.uniform(0.9, 1.1),
                verify_s=0.1 * rng.uniform(0.9, 1.1),
                forwards=8,
            )
        )
    assert policy.choose(rows) == before[0]
    assert np.array_equal(policy.cost.verify_s(np.arange(1, 40)), before[1])
    assert not hasattr(RoundCostModel, "observe_round") and not hasattr(RoundCostModel, "verify_slope")


def test_verify_curve_never_falls():
    cost = RoundCostModel({"verify": {"tokens": [1, 16, 64], "seconds": [0.02, 0.01, 0.03]}})
    n = np.arange(0, 200)
    assert (np.diff(cost.verify_s(n)) >= 0).all()


# ---- allocation
def test_free_rounds_draft_every_row_to_its_cap():
    cost = cost_model(verify_at_1=0.02)  # verification costs the same at any size, drafting nothing
    rows = [
        RowInfo("a", 15, acceptance=0.3),
        RowInfo("b", 7, acceptance=0.9),
        RowInfo("c", 32, source=PLD, acceptance=0.5),
        RowInfo("d", 5, source=NONE, acceptance=0.9),
        RowInfo("e", 4, acceptance=0.6, tokens_per_forward=2.0),
    ]
    assert plan(rows, cost).ks == [15, 7, 32, 0, 4]


def test_compute_bound_and_low_acceptance_gives_plain_decoding():
    cost = cost_model(verify_at_1=0.001, per_token=0.01, per_forward=0.002, per_row_forward=0.0005)
    rows = [RowInfo(str(b), 15, acceptance=0.2) for b in range(8)]
    assert plan(rows, cost).ks == [0] * 8


def test_higher_acceptance_drafts_more():
    cost = cost_model(verify_at_1=0.02, per_token=0.0004, per_forward=0.004, per_row_forward=0.0005)
    rows = [RowInfo(str(a), 15, acceptance=a) for a in (0.3, 0.5, 0.7, 0.85, 0.95)]
    ks = plan(rows, cost).ks
    assert ks == sorted(ks) and ks[0] < ks[-1]


def random_instance(rng, curve: str, mixed: bool = True):
    """B <= 3 rows, limit <= 4. curve: "linear", "convex" or "any" (non-decreasing) verify(n);
    mixed: model, lookup and non-drafting rows, some with MLA, some fixed."""
    rows = []
    for b in range(int(rng.integers(1, 4))):
        drafter = str(rng.choice([MODEL, MODEL, PLD, NONE])) if mixed else MODEL
        a = float(rng.choice([0.0, 1.0, 0.99])) if rng.random() < 0.15 else float(rng.uniform(0, 1))
        rows.append(
            RowInfo(
                str(b),
                int(rng.integers(0, 5)),
                source=drafter,
                acceptance=a,
                tokens_per_forward=float(rng.choice([1.0, 1.0, 1.5, 2.0])) if mixed else 1.0,
                fixed=bool(rng.random() < 0.15) and mixed,
            )
        )
    tokens = np.sort(
        np.concatenate([[1], rng.choice(np.arange(2, 20), size=int(rng.integers(1, 4)), replace=False)])
    ).astype(float)
    if curve == "linear":
        tokens = tokens[[0, -1]]
        slopes = np.full(1, rng.uniform(0, 0.01) * rng.choice([0, 1, 1]))
    elif curve == "convex":
        slopes = np.sort(rng.uniform(0, 0.003, len(tokens) - 1))
    else:
        slopes = rng.uniform(0, 0.003, len(tokens) - 1)
    seconds = rng.uniform(0.001, 0.05) + np.concatenate([[0], np.cumsum(slopes * np.diff(tokens))])
    draft = {
        "per_round": rng.uniform(0, 0.01) * rng.choice([0, 1]),
        "per_forward": rng.uniform(0, 0.03),
        "per_row_forward": rng.uniform(0, 0.01),
    }
    verify = {"tokens": tokens.tolist(), "seconds": seconds.tolist()}
    if curve == "batched":  # the forward by shape, [B, max k + 1]: any table non-decreasing both ways
        steps = rng.uniform(0, 0.01, (3, 4)) * rng.choice([0, 1], (3, 4), p=[0.3, 0.7])
        table = rng.uniform(0.001, 0.05) + np.cumsum(np.cumsum(steps, 0), 1)
        verify["batch"] = {"rows": [1, 2, 3], "tokens_per_row": [1, 2, 3, 5], "seconds": table.tolist()}
    return rows, RoundCostModel({"verify": verify, "draft": draft})


def gaps(seed, curve, mixed, n=300, overlap=False):
    """Relative shortfall of the allocation's rate from the brute-force optimum, per instance."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows, cost = random_instance(rng, curve, mixed)
        p = plan(rows, cost, overlap=overlap)
        assert p.tokens / p.seconds == pytest.approx(rate(p.ks, rows, cost, overlap), rel=1e-9)
        best = brute_force(rows, cost, overlap)
        out.append((best - rate(p.ks, rows, cost, overlap)) / best)
    return np.array(out)


@pytest.mark.parametrize("curve, mixed", [("linear", True), ("convex", True), ("convex", False)])
def test_allocation_matches_brute_force(curve, mixed):
    assert gaps(10, curve, mixed).max() <= 1e-9


def test_allocation_near_brute_force_on_batch_tables():
    # A padded forward shares the target like the drafter's forwards: candidates by width
    for mixed in (False, True):
        g = gaps(12, "batched", mixed)
        assert g.max() <= 1e-9
    # draft-ahead's overlapped round: one more draft can cross into a drafter forward only a
    # second fills (seed 3 gave a plan 3.5% short before the two-draft steps)
    for seed in (3, 12):
        assert gaps(seed, "batched", True, n=200, overlap=True).max() <= 1e-9


def test_allocation_near_brute_force_on_any_curve():
    # A non-convex verify(n) with rows of different drafter costs: a local optimum at worst.
    for mixed in (False, True):
        g = gaps(11, "any", mixed)
        assert g.max() <= 0.2 and (g <= 1e-9).mean() >= 0.97


def test_a_jump_from_one_to_two_tokens_does_not_hold_k_at_zero():
    # tune-k's fp32 curve on a 2-core CPU: one token takes a faster kernel than two, so every first
    # draft alone lowers the rate, while k = 7 raises it (the one-row optimum is found exactly).
    cost = RoundCostModel(
        {
            "verify": {"tokens": [1, 2, 4, 8, 16, 32], "seconds": [0.288, 0.617, 0.751, 0.751, 0.956, 1.245]},
            "draft": {"rows": [1, 2, 4, 8], "seconds": [0.038, 0.040, 0.042, 0.054]},
        }
    )
    for a in (0.75, 0.86):
        rows = [RowInfo("r", 15, acceptance=a)]
        assert rate([1], rows, cost) < rate([0], rows, cost)
        ks = plan(rows, cost).ks
        assert ks[0] > 1
        assert rate(ks, rows, cost) == pytest.approx(brute_force(rows, cost))
    rows = [RowInfo(str(b), 15, acceptance=0.8) for b in range(3)]
    assert min(plan(rows, cost).ks) > 0


def test_caps_are_respected():
    rng = np.random.default_rng(5)
    for _ in range(100):
        B = int(rng.integers(1, 65))
        rows = [
            RowInfo(
                str(b),
                int(rng.integers(0, 33)),
                source=str(rng.choice([MODEL, PLD, NONE])),
                acceptance=float(rng.uniform(0, 1)),
                tokens_per_forward=float(rng.uniform(1, 3)),
                fixed=bool(rng.random() < 0.1),
            )
            for b in range(B)
        ]
        cost = cost_model(rng.uniform(0.001, 0.05), rng.uniform(0, 0.001), rng.uniform(0, 0.01), rng.uniform(0, 0.001))
        ks = plan(rows, cost).ks
        for k, r in zip(ks, rows):
            assert 0 <= k <= (0 if r.source == NONE else r.limit)
            if r.fixed and r.source != NONE:
                assert k == r.limit
    assert plan([], cost).ks == []


def test_draft_seconds_charge_a_forward_only_for_raising_the_longest_row():
    cost = cost_model(verify_at_1=0.02, per_token=0.0003, per_forward=0.05, per_row_forward=0.001, per_round=0.002)
    rows = [RowInfo("a", 8), RowInfo("b", 8), RowInfo("c", 8, source=PLD)]
    below = cost.round_s([4, 2, 0], rows) - cost.round_s([4, 0, 0], rows)
    assert below == pytest.approx(2 * (0.001 + 0.0003))  # b's share of forwards that run anyway
    above = cost.round_s([5, 2, 0], rows) - cost.round_s([4, 2, 0], rows)
    assert above == pytest.approx(0.05 + 0.001 + 0.0003)  # one more forward, a alone in it
    assert cost.round_s([0, 0, 6], rows) - cost.round_s([0, 0, 0], rows) == pytest.approx(6 * 0.0003)
    assert cost.round_s([1, 0, 0], rows) - cost.round_s([0, 0, 0], rows) == pytest.approx(0.002 + 0.05 + 0.001 + 0.0003)
    mla = [RowInfo("a", 8, tokens_per_forward=2.0)]  # two drafts per forward: 5 drafts, 3 forwards
    assert cost.round_s([5], mla) - cost.round_s([0], mla) == pytest.approx(0.002 + 3 * 0.05 + 2.5 * 0.001 + 5 * 0.0003)


def test_rows_together_pay_for_a_forward_no_row_pays_for_alone():
    cost = cost_model(verify_at_1=0.03, per_token=0.0005, per_forward=0.01)
    rows = [RowInfo(str(b), 4, acceptance=0.9) for b in range(3)]
    start = rate([0, 0, 0], rows, cost)
    for b in range(3):  # every single first step lowers the rate: a plain greedy would stop here
        assert rate([int(i == b) for i in range(3)], rows, cost) < start
    ks = plan(rows, cost).ks
    assert all(k > 0 for k in ks)
    assert rate(ks, rows, cost) == pytest.approx(brute_force(rows, cost))


def test_a_row_below_the_longest_drafts_at_its_share():
    cost = cost_model(verify_at_1=0.01, per_token=0.0001, per_forward=0.005, per_row_forward=0.0002)
    weak = RowInfo("weak", 8, acceptance=0.5)
    assert plan([weak], cost).ks == [0]  # alone it would pay whole forwards
    ks = plan([RowInfo("strong", 8, acceptance=0.97), weak], cost).ks
    assert ks[0] > 0 and 0 < ks[1] <= ks[0]


def test_fixed_rows_keep_their_k_and_the_others_adapt():
    cost = cost_model(verify_at_1=0.02, per_token=0.0004, per_forward=0.004, per_row_forward=0.0005)
    rows = [RowInfo("fixed", 15, acceptance=0.2, fixed=True), RowInfo("auto", 15, acceptance=0.8)]
    ks = plan(rows, cost).ks
    assert ks[0] == 15
    # The fixed row already runs 15 forwards, so the auto row's drafts cost only its share.
    assert ks[1] >= plan([RowInfo("auto", 15, acceptance=0.8)], cost).ks[0]


# ---- the forward by batch shape (a calibrated profile's table)
def shaped_profile(seconds_of, per_forward, per_row_forward, k_max=15, max_batch=8) -> CostProfile:
    """A profile as the calibration writes it from a fake forward cost seconds_of(rows, tokens per
    row): the table at its shapes and the token curve at its points."""
    rows, widths = batch_shapes(k_max, max_batch)
    table = BatchVerify(rows, widths, [[seconds_of(b, t) for t in widths] for b in rows])
    points = verify_points(k_max, max_batch)
    tokens, seconds = [b * (k + 1) for b, k in points], [seconds_of(b, k + 1) for b, k in points]
    return CostProfile(tokens, seconds, 0.0, per_forward, per_row_forward, 0.0, "fake", {}, table)


def planned_k(profile: CostProfile, batch: int, acceptance: float) -> int:
    """The k the allocator gives every one of `batch` alike rows (k auto up to 15)."""
    ks = plan([RowInfo(str(b), 15, acceptance=acceptance) for b in range(batch)], RoundCostModel(profile)).ks
    assert len(set(ks)) == 1  # alike rows, one k
    return ks[0]


def test_the_batch_table_round_trips_and_prices_the_padded_shape():
    profile = shaped_profile(lambda b, t: 0.25 + 0.03 * b + 0.004 * b * t, 0.03, 0.005)
    again = CostProfile.from_dict(yaml.safe_load(yaml.safe_dump(profile.to_dict())))
    assert again.to_dict() == profile.to_dict() and again.verify_batch.rows == [1, 2, 4, 8]
    assert RoundCostModel(again).batched and not RoundCostModel(flat_profile()).batched
    cost = RoundCostModel(profile)
    assert cost.verify_width_s(8, 4) == pytest.approx(0.25 + 0.24 + 0.128)  # a measured shape
    assert cost.verify_width_s(3, 3) == pytest.approx(0.25 + 0.09 + 0.036)  # between shapes: linear
    assert cost.verify_width_s(16, 32) == pytest.approx(0.25 + 0.48 + 2.048)  # past them: linear too
    # Rows are padded to the widest: a row below it verifies for free, widening pays for all rows.
    assert cost.verify_round_s([4, 0, 0]) == cost.verify_round_s([4, 4, 4]) == pytest.approx(cost.verify_width_s(3, 5))
    rows = [RowInfo(str(b), 8) for b in range(3)]
    assert cost.round_s([4, 1, 0], rows) - cost.round_s([4, 0, 0], rows) == pytest.approx(0.005)  # its drafting
    # Never falls, whatever the measurement's noise.
    noisy = CostProfile([1, 2], [0.1, 0.1], verify_batch=BatchVerify([1, 2], [1, 2], [[0.2, 0.1], [0.15, 0.3]]))
    widths = RoundCostModel(noisy).verify_width_s(2, np.linspace(0, 5, 21))
    assert (np.diff(widths) >= 0).all() and RoundCostModel(noisy).verify_width_s(2, 1) >= 0.2


def test_where_a_batch_verifies_many_tokens_for_about_one_it_drafts_at_8_rows():
    # GPU-like: a batch-8 forward of 8 x 4 tokens costs about its 8 x 1 step (memory-bound)
    gpu = shaped_profile(lambda b, t: 0.02 * (1 + 0.002 * b * t), per_forward=0.001, per_row_forward=0.0001)
    assert RoundCostModel(gpu).verify_width_s(8, 4) <= 1.05 * RoundCostModel(gpu).verify_width_s(8, 1)
    assert planned_k(gpu, 8, acceptance=0.8) >= 3
    assert planned_k(gpu, 1, acceptance=0.8) >= planned_k(gpu, 8, acceptance=0.8)


def test_where_the_forward_is_linear_in_its_tokens_a_batch_of_8_drafts_little():
    # Compute-bound CPU: seconds linear in the forward's tokens. One row pays for its drafts
    # (the fixed part dominates); at 8 rows every draft a row costs 8 tokens of compute.
    cpu = shaped_profile(lambda b, t: 0.1 + 0.05 * b * t, per_forward=0.01, per_row_forward=0.002)
    assert planned_k(cpu, 1, acceptance=0.8) > 0
    assert planned_k(cpu, 8, acceptance=0.8) <= 1


def test_b_rows_cost_more_than_one_row_of_their_tokens_and_the_plan_sees_it():
    # A CPU whose forward has a cost per row (each attends its own context): 8 one-token rows take
    # 0.52 s where one row of 8 tokens takes 0.31. The token curve alone (sum (k + 1) tokens, a
    # profile without the table) prices batch 8's plain step at the one-row 8 tokens, so a draft
    # looks dearer against it than it is: it planned fewer drafts than the shapes pay for (the
    # closing note's 16 users: ~1.5 drafts a round where k 3 paid).
    shape = lambda b, t: 0.25 + 0.03 * b + 0.004 * b * t  # noqa: E731
    profile = shaped_profile(shape, per_forward=0.03, per_row_forward=0.005)
    tokens_only = CostProfile(profile.verify_tokens, profile.verify_seconds, 0.0, 0.03, 0.005)
    truth = RoundCostModel(profile)
    rows = [RowInfo(str(b), 15, acceptance=0.8) for b in range(8)]
    by_shape, by_tokens = planned_k(profile, 8, 0.8), planned_k(tokens_only, 8, 0.8)
    assert by_shape >= 3 and by_shape > by_tokens
    assert rate([by_shape] * 8, rows, truth) > rate([by_tokens] * 8, rows, truth)


def test_min_confidence_rule():
    assert min_confidence_for(rate=100.0, marginal_s=0.002) == pytest.approx(0.2)
    assert min_confidence_for(rate=1e6, marginal_s=1.0) == 1.0
    assert min_confidence_for(rate=100.0, marginal_s=0.0) == 0.0
    policy = SpeculationPolicy(cost_model(0.02, 0.0004, 0.004, 0.0005))
    assert policy.min_confidence() == 0.0
    policy.choose([RowInfo("a", 15, acceptance=0.8), RowInfo("b", 15, acceptance=0.6)])
    p = policy.last
    assert policy.min_confidence("a") == pytest.approx(p.tokens / p.seconds * p.marginal_s)
    assert 0 < policy.min_confidence() < 1


# ---- SpeculationPolicy: learning, probes, the cost check, determinism
def run_policy(policy, truth, verify, draft, rounds, *, k_max=8, noise=0.0, noise_seed=0, seed=7):
    """Rounds of rows with per-token acceptance truth[key] on a fake cost (verify(tokens),
    draft(forwards, row_forwards), seconds), times scaled by noise in [1 - noise, 1 + noise];
    returns each round's ks. The acceptance draws come from their own generator, so only the
    plans can make two runs differ."""
    luck, clock = np.random.default_rng(seed), np.random.default_rng(noise_seed)
    keys, history = list(truth), []
    for _ in range(rounds):
        ks = policy.choose([RowInfo(key, k_max) for key in keys])
        kept = [simulate_round(luck, truth[key], k)[1] for key, k in zip(keys, ks)]
        forwards, jitter = max(ks), clock.uniform(1 - noise, 1 + noise, size=2)
        policy.record(
            RoundTrace(
                keys,
                ks,
                kept,
                kinds=[MODEL] * len(keys),
                draft_s=draft(forwards, sum(ks)) * jitter[0],
                verify_s=verify(sum(k + 1 for k in ks)) * jitter[1],
                forwards=forwards,
                row_forwards=ks,
            )
        )
        history.append(ks)
    return history


# A seed that overprices drafting: every token of a verification costs a whole forward, and a
# drafter forward half of one (another machine's curve, or an fp32 curve on a bf16 machine).
WRONG_SEED = CostProfile([1, 2, 16], [0.1, 0.2, 1.6], 0.0, 0.05, 0.0)


def test_policy_learns_each_rows_acceptance():
    rng = np.random.default_rng(6)
    truth = {"good": 0.9, "poor": 0.2, "fixed": 0.5}
    policy = SpeculationPolicy.from_profile(flat_profile(0.02, 0.0004, 0.003, 0.0004))
    for _ in range(150):
        rows = [RowInfo(key, 10, fixed=key == "fixed") for key in truth]
        ks = policy.choose(rows)
        assert ks[2] == 10 and all(0 <= k <= 10 for k in ks)
        kept = [simulate_round(rng, truth[key], k)[1] for key, k in zip(truth, ks)]
        policy.record(
            RoundTrace(list(truth), ks, kept, kinds=[MODEL] * 3, draft_s=0.05, verify_s=0.03, forwards=max(ks))
        )
    assert policy.tracker.estimate("good") == pytest.approx(0.9, abs=0.08)
    assert policy.tracker.estimate("fixed") == pytest.approx(0.5, abs=0.15)
    ks = policy.choose([RowInfo(key, 10, fixed=key == "fixed") for key in truth])
    assert ks[0] > ks[1]  # the good row drafts more than the poor one
    policy.release(list(truth))
    assert policy.tracker.rows == {} and policy._idle == {}
    assert policy.choose([]) == []


def test_record_takes_each_rows_kind_from_the_caller():
    """Rounds without a choose() (no row has k "auto"): a prompt-lookup row is not a drafter row.
    Before, record() took kinds from the last choose() and defaulted to the model drafter."""
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_forward=0.01, per_row_forward=0.002))
    for _ in range(3):
        policy.record(
            RoundTrace(
                ["lookup", "model"],
                [6, 4],
                [6, 4],
                kinds=[PLD, MODEL],
                draft_s=0.024,
                verify_s=0.1,
                forwards=2,
                row_forwards=[5, 2],
            )
        )
    # The drafter forwards each row was in reach the tracker (MLA: 4 drafts in 2 forwards) for
    # model rows only; a lookup row has no drafter forwards whatever the caller passed.
    assert policy.tracker.tokens_per_forward("model") > 1.4
    assert policy.tracker.tokens_per_forward("lookup") == 1.0
    # The cost check predicted the drafting call from the model row alone: 2 forwards, 2 rows in them.
    assert [p for _, p in policy.check.draft] == pytest.approx([0.01 * 2 + 0.002 * 2] * 3)


def test_a_wrong_seed_corrects_itself_where_drafting_pays():
    verify = lambda n: 0.1 + 0.002 * n  # this machine: a verification costs about one forward
    draft = lambda f, rf: 0.01 * f + 0.001 * rf
    policy = SpeculationPolicy.from_profile(WRONG_SEED)
    assert policy.choose([RowInfo("r", 8)]) == [0]  # the seed alone never drafts
    policy.release(["r"])
    history = run_policy(policy, {"r": 0.8}, verify, draft, 60)
    first = next(i for i, ks in enumerate(history) if ks[0] > 0 and ks[0] != policy.probe_k)
    assert first <= 30  # a few probes: the cost check replaced the seed
    assert policy.check.corrections >= 1 and policy.profile.source == "corrected from measured rounds"
    assert np.mean([ks[0] for ks in history[-20:]]) >= 4  # and it keeps drafting


def test_the_check_corrects_once_and_never_touches_a_profile_measured_here():
    """A profile from elsewhere is corrected at most once (then plans read that one only); a
    profile measured on this engine's parts is frozen even where live rounds contradict its shape
    (issue 19: a correction mid-service changed the plan, hence the text, of the next request)."""
    verify = lambda n: 0.1 + 0.002 * n
    draft = lambda f, rf: 0.01 * f + 0.001 * rf
    policy = SpeculationPolicy.from_profile(WRONG_SEED)
    run_policy(policy, {"r": 0.8}, verify, draft, 60)
    corrected = policy.profile
    assert policy.check.corrections == 1 and policy.frozen
    run_policy(policy, {"s": 0.8}, lambda n: 0.3 + 0.2 * n, draft, 40)  # a new shape: ignored now
    assert policy.check.corrections == 1 and policy.profile is corrected

    here = SpeculationPolicy.from_profile(None)
    here.set_profile(WRONG_SEED, measured_here=True)
    here.probe_budget = 1.0  # this seed prices a probe at 7 plain rounds: at 5% the first would wait 120
    history = run_policy(here, {"r": 0.8}, verify, draft, 60)
    assert here.check.corrections == 0 and here.profile.source == WRONG_SEED.source
    assert {ks[0] for ks in history} == {0, here.probe_k}  # the seed's plan, probes on the row's count


def test_probes_only_where_drafting_does_not_pay():
    """The same seed on a machine uniformly twice as slow, with a poor drafter: plain decoding,
    one probe round every probe_every + 1 rounds, by the row's own round count."""
    verify = lambda n: 2 * float(RoundCostModel(WRONG_SEED).verify_s(n))
    draft = lambda f, rf: 2 * 0.05 * f
    policy = SpeculationPolicy.from_profile(WRONG_SEED)
    history = run_policy(policy, {"r": 0.3}, verify, draft, 70)
    period = policy.probe_every + 1
    assert [ks[0] for ks in history] == [policy.probe_k if (i + 1) % period == 0 else 0 for i in range(70)]
    assert policy.check.corrections == 0  # a uniformly slower machine is not a wrong shape


def test_a_batch_planned_at_plain_decoding_probes_one_draft_now_and_then_every_row_in_turn():
    """A probe in a batch widens every row's verification (and a probe of probe_k drafts runs
    probe_k drafter forwards): where the plan drafts nothing, one row probes 1 draft every
    probe_every + 1 rounds, not one row at probe_k every round."""
    verify = lambda n: 2 * float(RoundCostModel(WRONG_SEED).verify_s(n))
    draft = lambda f, rf: 2 * 0.05 * f
    policy = SpeculationPolicy.from_profile(WRONG_SEED)
    truth = {f"r{b}": 0.3 for b in range(8)}
    history = np.array(run_policy(policy, truth, verify, draft, 112))  # [rounds, rows]
    period = policy.probe_every + 1
    probing = history.sum(1) > 0  # [rounds]
    assert probing.tolist() == [(i + 1) % period == 0 for i in range(112)]
    assert set(history.ravel()) == {0, 1} and history.sum(1).max() == 1  # one row, one draft
    assert history.sum(0).tolist() == [2] * 8  # every row in turn, twice in 16 probes
    assert policy.probes == 16 and policy.check.corrections == 0


def test_a_probe_in_a_batch_rides_at_the_plans_width():
    """A batch whose plan drafts (a fixed row's 2): a row left at k = 0 probes at the plan's widest
    k (below it a row verifies for free in the padded forward), not at probe_k."""
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_forward=0.01, per_row_forward=0.05))
    seen, probed = [], []
    for _ in range(6 * (policy.probe_every + 1)):
        before = policy.probes
        ks = policy.choose([RowInfo("fixed", 2, fixed=True), RowInfo("poor", 8, acceptance=0.0)])
        policy.record(
            RoundTrace(["fixed", "poor"], ks, [2, 0], kinds=[MODEL] * 2, draft_s=0.03, verify_s=0.1, forwards=max(ks))
        )
        seen.append(ks[1])
        probed += [ks[1]] * (policy.probes - before)
    # 2 drafts, the plan's width; every probe_every + 1 rounds until the cost check froze its
    # correction, then at the gap of a frozen profile (here the budget's: 24 rounds)
    assert probed == [2] * len(probed) and len(probed) >= 2
    assert seen.count(0) == len(seen) - len(probed)  # otherwise the plan leaves it at k 0


def test_a_batch_whose_only_drafts_are_lookups_probes_one_draft_now_and_then():
    """A fixed prompt-lookup row drafts 4 (no drafter forward) beside 4 model rows planned at
    k = 0: the drafter runs for a probe of 1 draft every probe_every + 1 rounds, not for a probe
    at the lookup's width every round as the rows fall due in turn."""
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_forward=0.01, per_row_forward=0.05))
    keys = ["lookup", *(f"poor{b}" for b in range(4))]
    period, probed = policy.probe_every + 1, []
    for _ in range(4 * period):
        before = policy.probes
        rows = [RowInfo("lookup", 4, source=PLD, fixed=True), *(RowInfo(k, 8, acceptance=0.0) for k in keys[1:])]
        ks = policy.choose(rows)
        kinds = [PLD] + [MODEL] * 4
        policy.record(RoundTrace(keys, ks, [0] * 5, kinds=kinds, draft_s=0.01, verify_s=0.1, forwards=max(ks[1:])))
        probed.append(max(ks[1:]) if policy.probes > before else 0)
    assert ks[0] == 4 and probed == [0] * (period - 1) + [1] + ([0] * (period - 1) + [1]) * 3


def test_plans_do_not_follow_wall_clock_noise():
    """A row alone on a calibrated profile, times with 10% noise: the same ks whatever the noise."""
    verify = lambda n: 0.1 + 0.002 * n
    draft = lambda f, rf: 0.01 * f + 0.001 * rf
    calibrated = CostProfile([1, 101], [verify(1), verify(101)], 0.0, 0.01, 0.001)
    alone = {
        key: [
            run_policy(SpeculationPolicy.from_profile(calibrated), {key: a}, verify, draft, 80, noise=x, noise_seed=i)
            for i, x in enumerate((0.0, 0.1, 0.1, 0.1))
        ]
        for key, a in (("good", 0.85), ("poor", 0.1))
    }
    assert all(run == runs[0] for runs in alone.values() for run in runs)
    good, poor = (np.array(alone[key][0]).ravel() for key in ("good", "poor"))
    assert good.mean() > 2 * poor.mean() > 0  # a row's k follows its own acceptance


def test_rounds_under_load_are_planned_from_the_costs_measured_under_load():
    """A profile measured here (frozen) that prices the drafter at a third of what it costs once
    two rows run (a served ingress streams text while the drafter works): the two-row rounds
    move to the plan of the true costs within a few refits; a row alone keeps the frozen plan."""
    verify = lambda n: 0.1 + 0.01 * n
    true_draft = (0.0, 0.06, 0.006)  # per round, per forward, per row in a forward
    draft = lambda f, rf: true_draft[1] * f + true_draft[2] * rf
    measured = CostProfile([1, 101], [verify(1), verify(101)], 0.0, true_draft[1] / 3, true_draft[2] / 3)
    truth = CostProfile([1, 101], [verify(1), verify(101)], *true_draft)
    policy = SpeculationPolicy.from_profile(measured)
    policy.set_profile(measured, measured_here=True)
    pair = [RowInfo("a", 8, acceptance=0.8), RowInfo("b", 8, acceptance=0.8)]
    frozen_pair, true_pair = plan(pair, RoundCostModel(measured)).ks, plan(pair, RoundCostModel(truth)).ks
    assert sum(true_pair) < sum(frozen_pair)  # the cheap drafter of the profile drafts longer
    assert policy.choose(pair) == frozen_pair  # no rounds under load yet: the frozen profile
    for _ in range(5 * policy.under_load.every):
        ks = policy.choose(pair)
        policy.record(
            RoundTrace(
                ["a", "b"],
                ks,
                ks,
                kinds=[MODEL, MODEL],
                draft_s=draft(max(ks), sum(ks)),
                verify_s=verify(sum(k + 1 for k in ks)),
                forwards=max(ks),
                row_forwards=ks,
            )
        )
    assert policy.under_load.refits >= 1
    assert policy.under_load.draft_ratio == pytest.approx(3.0, rel=0.05)
    assert policy.choose(pair) == true_pair
    alone = [RowInfo("c", 8, acceptance=0.8)]
    assert policy.choose(alone) == plan(alone, RoundCostModel(measured)).ks  # a row alone: frozen
    assert policy.cost_for(1) is policy.cost and policy.check.corrections == 0
    policy.set_profile(measured, measured_here=True)  # a recalibration starts the load model over
    assert policy.under_load.model is None and policy.choose(pair) == frozen_pair


def test_under_load_reads_the_drafter_against_the_target_of_the_same_round():
    """A host that slows both halves of a round alike (drift) changes nothing; rounds without a
    drafting call are not counted; the model comes only after min_rounds, refit every `every`."""
    cost = RoundCostModel(flat_profile(0.1, 0.01, per_forward=0.02, per_row_forward=0.002))
    load = UnderLoad(every=4, min_rounds=4)
    ks = [2, 2, 2]
    draft, verify = float(cost.draft_s(2, 6)), float(cost.verify_round_s(ks))
    for i in range(12):
        slow = 1.0 + 0.3 * (i % 3)  # the host's speed drifts from round to round
        load.observe(cost, [0, 0, 0], 0, 0, 0.0, verify * slow)  # plain decoding: no ratio in it
        load.observe(cost, ks, 2, 6, draft * slow, verify * slow)
        assert (load.model is None) == (i < 3)
    assert load.rounds == 12 and load.refits == 3 and load.draft_ratio == pytest.approx(1.0)
    assert load.model.draft_s(2, 6) == pytest.approx(cost.draft_s(2, 6))
    for _ in range(32):  # the drafter now costs twice its share of the round: the window follows
        load.observe(cost, ks, 2, 6, 2 * draft, verify)
    assert load.applied == pytest.approx(2.0) and load.model.draft_s(2, 6) == pytest.approx(2 * cost.draft_s(2, 6))
    assert load.model.verify_round_s(ks) == pytest.approx(verify)  # the target's shape is the profile's


@pytest.mark.parametrize("true_width, planned", [(0.015, 2), (0.06, 0)])
def test_rounds_under_load_price_the_width_as_they_measure_it(true_width, planned):
    """The calibration priced one more token a row at 0.03 s a row and planned k 1 for 8 rows;
    under load it costs half (k 2 pays) or twice that (plain decoding pays), while the host's
    memory-bound base forward and the drafter drift by 30% over the rounds. Width steps give
    pairs of rounds of two widths, and the batch moves to the plan of the true costs; a row alone
    keeps the frozen plan."""
    frozen = shaped_profile(lambda b, t: 0.3 + 0.02 * b + 0.03 * b * (t - 1), 0.03, 0.005)
    policy = SpeculationPolicy.from_profile(frozen)
    policy.set_profile(frozen, measured_here=True)
    rows = [RowInfo(str(b), 8, acceptance=0.8) for b in range(8)]
    keys = [r.key for r in rows]
    assert policy.choose(rows) == [1] * 8 and policy.width_steps == 0
    for i in range(150):
        ks = policy.choose(rows)
        slow = 1.0 + 0.3 * math.sin(i / 15)  # drift: the base and the drafter, not the width
        forwards = max(ks)
        policy.record(
            RoundTrace(
                keys,
                ks,
                ks,
                kinds=[MODEL] * 8,
                draft_s=(0.03 * forwards + 0.005 * sum(ks)) * slow * (forwards > 0),
                verify_s=(0.3 + 0.02 * 8) * slow + true_width * 8 * max(ks),
                forwards=forwards,
                row_forwards=ks,
            )
        )
    assert policy.width_steps > 0 and policy.under_load.pairs >= policy.under_load.min_pairs
    assert policy.under_load.beta == pytest.approx(true_width / 0.03, rel=0.1)
    policy.choose(rows)
    assert policy.last.ks == [planned] * 8
    alone = [RowInfo("c", 8, acceptance=0.8)]
    assert policy.choose(alone) == plan(alone, RoundCostModel(frozen)).ks


@pytest.mark.parametrize("width_every", [6, 0])
def test_a_drafting_round_under_load_pays_a_fixed_price_as_the_pairs_read_it(width_every):
    """Served, a round's first drafter forward shares the cores with that round's streaming: the
    drafter costs its profiled forwards plus 0.1 s a round, the host drifting by 30%. Read as one
    ratio, that price charges long drafts more, not less; the pairs of rounds the width steps make
    read the drafter's slope (as profiled) and its fixed price, and the batch moves from the
    profile's k 2 at 8 rows to the true costs' k 3. Without width steps the plan never varies and
    the one ratio stays."""
    shape = lambda b, t: 0.3 + 0.02 * b + 0.02 * b * (t - 1)  # noqa: E731
    frozen = shaped_profile(shape, 0.01, 0.002)
    truth = RoundCostModel(replace(frozen, draft_per_round=0.1))
    policy = SpeculationPolicy(RoundCostModel(frozen), AcceptanceTracker(), width_every=width_every)
    policy.set_profile(frozen, measured_here=True)
    rows = [RowInfo(str(b), 8, acceptance=0.8) for b in range(8)]
    keys = [r.key for r in rows]
    assert policy.choose(rows) == [planned_k(frozen, 8, 0.8)] * 8 == [2] * 8
    for i in range(400):
        ks = policy.choose(rows)
        slow, forwards = 1.0 + 0.3 * math.sin(i / 15), max(ks)
        policy.record(
            RoundTrace(
                keys,
                ks,
                ks,
                kinds=[MODEL] * 8,
                draft_s=float(truth.draft_s(forwards, sum(ks))) * slow,
                verify_s=shape(8, forwards + 1) * slow,
                forwards=forwards,
                row_forwards=ks,
            )
        )
    policy.choose(rows)
    if width_every:
        assert policy.under_load.draft_pairs >= policy.under_load.min_pairs
        assert policy.under_load.applied_slope == pytest.approx(1.0, rel=0.05)
        assert policy.under_load.applied_round_s == pytest.approx(0.1, rel=0.05)
        assert policy.last.ks == [planned_k(truth.profile, 8, 0.8)] * 8 == [3] * 8
    else:
        assert policy.under_load.draft_pairs == 0 and policy.under_load.applied_slope is None
        assert max(policy.last.ks) < planned_k(truth.profile, 8, 0.8)  # one ratio: never the true k


def test_width_pairs_are_consecutive_rounds_of_the_same_rows_at_two_widths():
    """beta solves a pair exactly whatever the base's drift; a pair needs the same rows count and
    another width, and a skipped round (a row alone, a prefill) pairs with nothing; a profile
    without a batch table reads no width."""
    truth = lambda b, t: 0.3 + 0.02 * b + 0.01 * b * (t - 1)  # noqa: E731
    cost = RoundCostModel(shaped_profile(lambda b, t: 0.3 + 0.02 * b + 0.03 * b * (t - 1), 0.03, 0.005))
    base, w = 0.3 + 0.16, lambda t: 0.03 * 8 * (t - 1)  # noqa: E731
    assert width_price(base, w(2), 2 * truth(8, 2), w(3), 2 * truth(8, 3)) == pytest.approx(1 / 3)  # a host 2x slower
    assert width_price(base, w(2), 1.0, w(3), 0.9) == 0.25 and width_price(base, w(2), 1.0, w(3), 9.0) == 4.0
    assert width_price(base, w(2), 1.0, w(2), 1.2) is None
    load = UnderLoad(every=2, min_rounds=100, min_pairs=2)
    load.observe(cost, [1] * 8, 0, 0, 0.0, truth(8, 2))
    load.observe(cost, [1] * 4, 0, 0, 0.0, truth(4, 2))  # other rows: no pair
    load.skip()
    load.observe(cost, [2] * 4, 0, 0, 0.0, truth(4, 3))  # after a skip: no pair
    assert load.pairs == 0 and load.draft_pairs == 0 and load.model is None
    for k in (1, 2, 1):
        load.observe(cost, [k] * 4, 0, 0, 0.0, truth(4, k + 1))
    assert load.pairs == 3 and load.beta == pytest.approx(1 / 3) and load.applied_beta == pytest.approx(1 / 3)
    assert load.model.verify_width_s(4, 3) == pytest.approx(truth(4, 3))
    assert load.model.verify_width_s(8, 5) == pytest.approx(truth(8, 5))
    assert load.model.draft_s(2, 8) == pytest.approx(cost.draft_s(2, 8))  # no drafter rounds: its price
    flat = UnderLoad(every=1, min_rounds=100, min_pairs=1)
    for k in (1, 2, 1):
        flat.observe(RoundCostModel(flat_profile(0.1, 0.01)), [k] * 4, 0, 0, 0.0, 0.1 + 0.001 * k)
    assert flat.pairs == 0 and flat.model is None


def test_cost_check_ignores_scale_and_fixes_shape():
    cost = RoundCostModel(flat_profile(0.1, 0.01, per_forward=0.02))
    check = CostCheck()
    for n in (1, 9) * 5:  # three times slower everywhere: the same plan
        assert check.observe(cost, n, 3 * cost.verify_s(n), 2, 2, 3 * cost.draft_s(2, 2)) is None
    check, fixed = CostCheck(), None
    for n in (1, 9) * 5:  # verifying 9 tokens costs what 1 does: the slope was wrong
        fixed = fixed or check.observe(cost, n, 0.11, 0, 0, 0.0)
    assert fixed is not None
    corrected = RoundCostModel(fixed)
    assert corrected.verify_s(9) == pytest.approx(0.11) and corrected.verify_s(1) == pytest.approx(0.11)


def test_cost_check_compares_a_batch_table_by_shape_and_corrects_it_as_a_table():
    shape = lambda b, t: 0.25 + 0.03 * b + 0.004 * b * t  # noqa: E731
    cost = RoundCostModel(shaped_profile(shape, 0.03, 0.005))
    assert point_of(cost, [3, 0, 1]) == (3, 4) and point_of(RoundCostModel(flat_profile()), [3, 0, 1]) == 7
    points = [(1, 1), (8, 1), (8, 4)] * 5
    check = CostCheck()
    for point in points:  # this table, three times slower everywhere: the same plan
        assert check.observe(cost, point, 3 * shape(*point), 2, 2, 3 * cost.draft_s(2, 2)) is None
    # A table from elsewhere, where a row in the batch cost 4x as much: corrected, still a table.
    elsewhere = RoundCostModel(shaped_profile(lambda b, t: 0.25 + 0.12 * b + 0.004 * b * t, 0.03, 0.005))
    check, fixed = CostCheck(), None
    for point in points:
        fixed = fixed or check.observe(elsewhere, point, shape(*point), 0, 0, 0.0)
    assert fixed is not None and RoundCostModel(fixed).batched
    # The shapes measured (3 rounds each when it fired) exactly; one not yet measured is scaled
    # by the ratio at the nearest shape seen, nearer the truth than it was.
    for point in [(1, 1), (8, 1)]:
        assert RoundCostModel(fixed).verify_width_s(*point) == pytest.approx(shape(*point))
    error = lambda model: abs(model.verify_width_s(8, 4) - shape(8, 4))  # noqa: E731
    assert error(RoundCostModel(fixed)) < 0.2 * error(elsewhere)


# ---- in the engine (tiny random models)
class FakeTime:
    """A clock for the engine module: every perf_counter() call advances by `tick` times a random
    factor in [1 - noise, 1 + noise] (wall-clock noise injected where the engine reads time)."""

    def __init__(self, tick: float, noise: float, seed: int):
        self.t, self.tick, self.noise = 0.0, tick, noise
        self.rng = np.random.default_rng(seed)

    def perf_counter(self) -> float:
        self.t += self.tick * self.rng.uniform(1 - self.noise, 1 + self.noise)
        return self.t


@pytest.fixture(scope="module")
def tiny_pair():
    from fly_serve.loading.loading import load_model

    return load_model("tiny:0", "fp32"), load_model("tiny:1", "int8")


def tiny_auto_engine(tiny_pair, profile):
    from fly_serve.build import build_engine
    from fly_serve.loading.tiny import tiny_tokenizer

    target, drafter = tiny_pair
    return build_engine(
        target, drafter, tokenizer=tiny_tokenizer(), speculation_profile=profile, progress=lambda m: None
    )


def run_alone(engine, prompt: str) -> tuple[list[int], list[int]]:
    """One greedy k "auto" request alone: its tokens and the drafts of each of its rounds."""
    req = engine.add(prompt, dict(mode="spd", k="auto", k_max=8, max_tokens=48, temperature=0.0))
    drafts = []
    while not req.finished:
        before = req.stats.drafted
        engine.step()
        drafts.append(req.stats.drafted - before)
    return req.generated, drafts


def test_the_same_request_alone_gets_the_same_plan_and_text(tiny_pair, monkeypatch):
    """The same prompt alone, several times on one engine and on a fresh one, under different
    wall-clock noise: identical tokens and identical drafts round by round."""
    import fly_serve.engine.engine as engine_module

    # The profile the fake clock realizes: a round's draft and verify calls take one tick each.
    tick = 0.05
    profile = CostProfile([1, 65], [tick, 1.6 * tick], 0.85 * tick, 0.02 * tick, 0.0)
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    runs = []
    engine = tiny_auto_engine(tiny_pair, profile)
    for seed in range(3):
        monkeypatch.setattr(engine_module, "time", FakeTime(tick, 0.05, seed))
        runs.append(run_alone(engine, prompt))
    monkeypatch.setattr(engine_module, "time", FakeTime(tick, 0.0, 9))
    fresh = tiny_auto_engine(tiny_pair, profile)
    runs.append(run_alone(fresh, prompt))
    assert all(r == runs[0] for r in runs)
    assert engine.policy.check.corrections == 0 and engine.policy.tracker.rows == {}
    assert sum(runs[0][1]) > 0  # it drafted (plans or probes)


def test_the_engine_reports_each_rows_drafter_forwards(tiny_pair):
    """row_forwards reach the policy from the model drafter (tokens per forward for MLA), also
    when no row has k "auto" (record runs every round)."""
    engine = tiny_auto_engine(tiny_pair, flat_profile(0.1))
    req = engine.add("abcabcabcabc", dict(mode="spd", k=4, max_tokens=30, temperature=0.0))
    engine.step()
    ev = engine.policy.tracker.rows[req.id]
    assert ev.forwards >= 1 and ev.drafted == 4


# ---- a model row drafting from its free sources instead (RowInfo.free_k)
def test_where_the_drafter_costs_too_much_a_model_row_drafts_its_free_proposal():
    """A drafter forward at 0.6 of a plain step (llama.cpp's 0.5B beside its 1.5B on a CPU) never
    pays; a lookup proposal that costs only its verification does."""
    policy = SpeculationPolicy(cost_model(0.035, per_token=0.008, per_forward=0.02))
    policy.tracker.observe(free_key("r"), drafted=6, kept=6)
    ks = policy.choose([RowInfo("r", 8, MODEL, acceptance=0.6, free_k=6)])
    assert policy.free == [True] and 0 < ks[0] <= 6
    cheap = SpeculationPolicy(cost_model(0.035, per_token=0.008, per_forward=0.0005))
    cheap.tracker.observe(free_key("r"), drafted=6, kept=1)  # the lookups rarely hold
    ks = cheap.choose([RowInfo("r", 8, MODEL, acceptance=0.9, free_k=6)])
    assert cheap.free == [False] and ks[0] > 0  # the drafter is cheap and right: it drafts


def test_without_a_free_proposal_or_with_a_fixed_k_the_model_plan_stands():
    policy = SpeculationPolicy(cost_model(0.035, per_token=0.008, per_forward=0.02))
    assert policy.choose([RowInfo("r", 8, MODEL, acceptance=0.6)]) == [0] and policy.free == [False]
    policy.choose([RowInfo("r", 4, MODEL, acceptance=0.6, fixed=True, free_k=6)])
    assert policy.free == [False]


def test_in_a_batch_only_the_rows_the_model_plan_idles_may_draft_free():
    """Three candidates: all by the model, all free, free where the model plan says k = 0."""
    policy = SpeculationPolicy(cost_model(0.05, per_token=0.004, per_forward=0.004))
    policy.tracker.observe(free_key("b"), drafted=4, kept=4)
    policy.tracker.observe(free_key("a"), drafted=4, kept=0)
    rows = [RowInfo("a", 8, MODEL, acceptance=0.95, free_k=4), RowInfo("b", 8, MODEL, acceptance=0.05, free_k=4)]
    policy.choose(rows)
    assert policy.free == [False, True]


def test_free_acceptance_is_kept_apart_and_released_with_the_row():
    policy = SpeculationPolicy(cost_model(0.035, per_token=0.008, per_forward=0.02))
    policy.record(RoundTrace([free_key("r")], [5], [5], kinds=[PLD], draft_s=0.0, verify_s=0.05))
    assert policy.tracker.estimate(free_key("r")) > policy.tracker.estimate("r") == policy.tracker.prior
    policy.release(["r"])
    assert free_key("r") not in policy.tracker.rows


def test_the_engine_drafts_k_auto_rows_from_prompt_lookup_where_the_drafter_does_not_pay(tiny_pair):
    """A drafter forward at 0.7 of a target step (the llama.cpp pair on a CPU: one draft pays only
    at an acceptance above 0.83, the prior is 0.7): a fly k "auto" row whose text repeats drafts
    its lookups, without a drafter forward, and strict FLy still gives the target's own greedy
    text. (At half a step, 0.02 s, one draft would pay at 0.69: the prior alone would run it.)"""
    engine = tiny_auto_engine(tiny_pair, flat_profile(0.035, per_token=0.004, per_forward=0.025))
    prompt = "abc def ghi abc def ghi abc def ghi abc def ghi abc def"
    params = dict(mode="fly", theta=1.0, k="auto", k_max=8, max_tokens=40, temperature=0.0)
    forwards = engine.drafters["model"].forwards
    req = engine.generate([prompt], params)[0]
    ar = engine.generate([prompt], dict(params, mode="ar"))[0]
    assert req.generated == ar.generated
    assert req.stats.drafted > 0  # drafted: lookups
    assert engine.drafters["model"].forwards - forwards <= engine.policy.probes  # only probes ran the drafter


def probe_gaps(profile: CostProfile, acceptance: float, rounds: int = 400) -> tuple[SpeculationPolicy, list[int]]:
    """A frozen policy's rounds between probes of one row whose drafts do not pay at its acceptance."""
    policy = SpeculationPolicy.from_profile(profile)
    policy.frozen = True
    probes_at = []
    for i in range(rounds):
        ks = policy.choose([RowInfo("r", 8, acceptance=acceptance)])
        if ks[0]:
            probes_at.append(i)
        policy.record(RoundTrace(["r"], ks, [0] * 1, kinds=[MODEL], draft_s=0.06 * ks[0], verify_s=0.1, forwards=ks[0]))
    return policy, np.diff(probes_at).tolist()


def test_with_a_profile_measured_here_probes_back_off_while_drafting_does_not_pay():
    """A frozen profile: probes only re-measure acceptance, so each one that leaves the plan at k 0
    doubles the row's gap (up to max_probe_every); once the plan drafts the row, the gap resets."""
    # a 4-draft probe costs 0.3 plain rounds (its budget: 6 rounds); drafting pays from acceptance 0.075
    policy, gaps = probe_gaps(flat_profile(0.1, per_token=0.004, per_forward=0.0035), acceptance=0.05)
    assert gaps[:4] == [13, 25, 49, 97] and set(gaps[4:]) == {97}  # 6, 12, 24, 48, then capped at 96 idle rounds
    assert policy.choose([RowInfo("r", 8, acceptance=0.99)])[0] > 0  # the plan drafts: gap back to 6
    assert "r" not in policy._gap


def test_a_probe_that_costs_several_plain_rounds_waits_until_it_costs_its_budget():
    """A drafter forward at 0.6 of a plain round (llama.cpp's pair on a CPU): a 4-draft probe costs
    0.32 s over a 0.1 s plain round, so after the first probe the next waits 64 rounds (5% of the
    time), not 12; the cap still holds."""
    policy, gaps = probe_gaps(flat_profile(0.1, per_token=0.02, per_forward=0.06), acceptance=0.3)
    assert gaps[0] == 65 and set(gaps[1:]) == {97}
    assert policy._budget_gap(RowInfo("r", 8, acceptance=0.3), 4) == 64


def test_the_drafters_catch_up_is_priced_as_its_share_of_a_target_forward():
    """A drafter that has not seen n tokens prefills them before it drafts: the target's n-token
    forward scaled by a one-row drafter forward against a one-token target forward."""
    cost = RoundCostModel(CostProfile([1, 16, 128], [0.08, 0.28, 1.28], 0.0, 0.03, 0.01))
    assert cost.catch_up_s(0) == 0.0
    assert cost.catch_up_s(16) == pytest.approx(0.28 * 0.04 / 0.08)
    assert cost.catch_up_s(100) > cost.catch_up_s(50) > cost.catch_up_s(16)


def test_a_row_that_the_drafter_lags_far_behind_decodes_plainly_on_a_frozen_profile():
    """A drafter forward at half a target step (llama.cpp's pair on a CPU): before a probe the
    drafter must prefill every token it missed, the prompt too, at more than the budget a plain
    round gives, so a row that does not draft from the start never probes. Where a drafter forward
    is a thirtieth of a step (a small drafter beside a large target), the same row probes after
    probe_every rounds."""

    def first_probe(profile: CostProfile, prompt: int = 90, rounds: int = 300) -> int | None:
        policy = SpeculationPolicy.from_profile(profile)
        policy.frozen = True
        for i in range(rounds):
            ks = policy.choose([RowInfo("r", 8, acceptance=0.0, drafter_lag=prompt + i)])
            if ks[0]:
                return i
            policy.record(RoundTrace(["r"], ks, [0], kinds=[MODEL], draft_s=0.0, verify_s=0.1))
        return None

    assert first_probe(flat_profile(0.1, per_token=0.02, per_forward=0.05)) is None
    assert first_probe(flat_profile(0.1, per_token=0.02, per_forward=0.05), prompt=0, rounds=1000) is None
    assert first_probe(flat_profile(0.1, per_token=0.001, per_forward=0.003)) == SpeculationPolicy().probe_every
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_token=0.02, per_forward=0.05))
    near, far = (policy._budget_gap(RowInfo("r", 8, drafter_lag=lag), 4) for lag in (0, 90))
    assert far > near  # the catch-up is in the probe's price


def test_a_lookup_row_is_probed_again_whatever_the_drafter_lag_it_reports():
    """The drafter's catch-up is a model row's price: a prompt-lookup row carries no drafter, so
    the lag the engine reports for it (its whole sequence: the drafter never saw it) must not put
    its probes out of reach on a frozen profile where the drafter is dear. Its probes come at the
    doubling gaps, as with no lag at all."""

    def probes(lag_of) -> list[int]:
        policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_token=0.02, per_forward=0.05))
        policy.frozen = True
        at = []
        for i in range(200):
            ks = policy.choose([RowInfo("r", 8, source=PLD, acceptance=0.0, drafter_lag=lag_of(i))])
            if ks[0]:
                at.append(i)
            policy.record(RoundTrace(["r"], ks, [0], kinds=[PLD], draft_s=0.0, verify_s=0.1))
        return at

    far, none = probes(lambda i: 90 + i), probes(lambda i: 0)
    assert far == none and len(far) >= 3  # probe_every, then doubled gaps up to max_probe_every


def test_free_drafts_that_failed_once_are_tried_again_after_plain_rounds():
    """A model row whose drafter does not pay and whose prompt lookup failed in its first round:
    the lookup's estimate ages back toward the prior while the row decodes plainly, so the lookup
    is tried again (a rewrite's copied body comes after a line that differs)."""
    # one lookup draft pays above acceptance 0.6: the prior (0.7) does, one failure (0.47) does not
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_token=0.06, per_forward=0.09))
    policy.frozen = True
    row = RowInfo("r", 8, drafter_lag=50, free_k=6)
    chosen = []
    for i in range(30):
        ks = policy.choose([row])
        free = policy.free[0] and ks[0] > 0
        chosen.append("free" if free else ("model" if ks[0] else "plain"))
        kept = [0] if i == 0 else [ks[0]]  # the first lookup fails, the later ones hold
        policy.record(
            RoundTrace(
                [free_key("r") if free else "r"], ks, kept, kinds=[PLD if free else MODEL], draft_s=0.0, verify_s=0.1
            )
        )
    assert chosen[0] == "free" and chosen[1] == "plain"  # one failure puts the lookup below paying
    assert "free" in chosen[2:] and "model" not in chosen  # and it comes back
    assert chosen[-1] == "free"


def test_the_engine_tells_the_policy_how_far_its_drafter_lags(tiny_pair):
    """RowInfo.drafter_lag: a row's whole prompt before its first draft, then the tokens committed
    since the model drafter last drafted it (a round's drafts and its bonus after a drafting round)."""
    engine = tiny_auto_engine(tiny_pair, flat_profile(0.035, per_token=0.004, per_forward=0.003))
    seen, choose = [], engine.policy.choose
    engine.policy.choose = lambda rows: seen.append(rows[0].drafter_lag) or choose(rows)
    drafter = engine.drafters["model"]
    req = engine.add("abc def ghi jkl", dict(mode="spd", k="auto", k_max=4, max_tokens=24, temperature=0.0))
    lags, model_drafted = [], []
    while not req.finished:
        forwards, before = drafter.forwards, len(req.tokens)
        engine.step()
        lags.append(seen[-1])
        model_drafted.append(len(req.tokens) - before if drafter.forwards > forwards else None)
    assert lags[0] == req.n_prompt
    after = [(lag, n) for lag, n in zip(lags[1:], model_drafted) if n is not None]
    assert after and all(lag == n for lag, n in after)  # what the drafting round committed


def test_k_auto_prices_each_candidate_drafters_own_catch_up():
    """Two drafters alike in cost and in the row's acceptance: the one that has seen the row (the
    other must prefill what it missed first) drafts it, whichever is listed first."""
    policy = SpeculationPolicy.from_profile(flat_profile(0.1, per_token=0.02, per_forward=0.01))
    policy.set_drafters(("a", "b"))
    policy.frozen = True

    def pick(lags: tuple[int, int]) -> str:
        policy.choose([RowInfo("r", 8, drafters=("a", "b"), drafter_lags=lags)])
        return policy.drafter_of[0]

    assert pick((0, 500)) == "a" and pick((500, 0)) == "b"
    assert pick((3, 3)) == "a"  # a tie: the first listed
    # one candidate left (the other in its backoff after a failure): that one
    policy.choose([RowInfo("r", 8, drafters=("b",), drafter_lags=(500,))])
    assert policy.drafter_of[0] == "b"


def test_free_drafts_the_prior_prices_out_are_probed_and_drafted_once_they_hold():
    """Where a wider verification costs much (2 tokens 1.8x one: llama.cpp on a 2-core CPU), free
    drafts at the prior acceptance (0.7) never pay, so a row that copies its prompt would decode
    plainly for good: a probe of its free drafts (after a gap that keeps them at
    free_probe_budget, 2%, of the time: 156 rounds here) measures them, and the row drafts them
    from then on."""
    policy = SpeculationPolicy()
    policy.set_profile(flat_profile(0.045, per_token=0.035, per_forward=0.03), measured_here=True)
    assert policy.choose([RowInfo("r", 8, MODEL, free_k=6)]) == [0]  # the prior alone: plain
    assert policy._budget_gap(policy._as_free(RowInfo("r", 8, MODEL, free_k=6)), 4, policy.free_probe_budget) == 156
    drafted = {}
    for i in range(1, 200):
        ks = policy.choose([RowInfo("r", 8, MODEL, free_k=6)])
        if ks[0] > 0 and policy.free == [True]:
            drafted[i] = ks[0]
            policy.record(RoundTrace([free_key("r")], ks, ks, kinds=[PLD], draft_s=0.0, verify_s=0.1))
        elif ks[0] > 0:  # the drafter's own probe (at its own budget), whose drafts fail
            policy.record(RoundTrace(["r"], ks, [0], kinds=[MODEL], draft_s=0.1, verify_s=0.2, forwards=ks[0]))
        else:
            policy.record(RoundTrace(["r"], [0], [0], kinds=[NONE], draft_s=0.0, verify_s=0.045))
    first = min(drafted)
    assert first == 156 and drafted[first] == 4  # the probe: probe_k drafts, after the budget's gap
    assert set(drafted) == set(range(first, 200))  # from then on every round drafts
    assert max(drafted.values()) > 1
    # a row whose free drafts fail after the probe goes back to plain and waits as long or longer each time
    policy = SpeculationPolicy()
    policy.set_profile(flat_profile(0.045, per_token=0.035, per_forward=0.03), measured_here=True)
    probes = []
    for i in range(1000):
        ks = policy.choose([RowInfo("q", 8, MODEL, free_k=6)])
        if ks[0] > 0 and policy.free == [True]:
            probes.append(i)
            policy.record(RoundTrace([free_key("q")], ks, [0], kinds=[PLD], draft_s=0.0, verify_s=0.08))
        elif ks[0] > 0:  # the drafter's own probe, its budget's gap apart (116 rounds here)
            policy.record(RoundTrace(["q"], ks, [0], kinds=[MODEL], draft_s=0.1, verify_s=0.2, forwards=ks[0]))
        else:
            policy.record(RoundTrace(["q"], [0], [0], kinds=[NONE], draft_s=0.0, verify_s=0.045))
    gaps = np.diff(probes)
    # (the budget's gap, 156 rounds, is past the doubling's cap here: the gaps hold there)
    assert len(probes) >= 3 and all(b >= a for a, b in zip(gaps, gaps[1:])) and min(gaps) > 156
    # in a batch a free probe would widen every row's forward: none there
    policy = SpeculationPolicy()
    policy.set_profile(flat_profile(0.045, per_token=0.035, per_forward=0.03), measured_here=True)
    for _ in range(100):
        assert policy.choose([RowInfo("a", 8, MODEL, free_k=6), RowInfo("b", 8, MODEL, free_k=6)]) == [0, 0]
        policy.record(RoundTrace(["a", "b"], [0, 0], [0, 0], kinds=[NONE, NONE], draft_s=0.0, verify_s=0.06))


def test_a_short_lookup_match_is_never_probed_and_priced_at_most_at_its_own_rate():
    """Prompt lookup after a match shorter than its longest n-gram (RowInfo.free_strong False):
    no free probe goes to it (on two cores its drafts seldom pay for the probe's width), and the
    plan prices it at no more than SHORT_MATCH_ACCEPTANCE however well the row's strong matches
    held; where a wider verification costs little it still drafts."""
    from fly_serve.k_auto.speculation_policy import SHORT_MATCH_ACCEPTANCE

    wide = flat_profile(0.045, per_token=0.035, per_forward=0.03)  # 2 tokens 1.8x one: a 2-core CPU
    policy = SpeculationPolicy()
    policy.set_profile(wide, measured_here=True)
    for _ in range(300):  # the free probe a strong match gets (test above) never comes
        ks = policy.choose([RowInfo("r", 8, MODEL, free_k=6, free_strong=False)])
        assert policy.free == [False]
        if ks[0] > 0:  # the drafter's own probe, its budget's gap apart
            policy.record(RoundTrace(["r"], ks, [0], kinds=[MODEL], draft_s=0.1, verify_s=0.2, forwards=ks[0]))
        else:
            policy.record(RoundTrace(["r"], [0], [0], kinds=[NONE], draft_s=0.0, verify_s=0.045))
    # the row's lookups held (a strong match drafted and kept all): its short match stays priced low
    policy.tracker.observe(free_key("r"), drafted=6, kept=6)
    assert policy.tracker.estimate(free_key("r")) > SHORT_MATCH_ACCEPTANCE
    assert policy._as_free(RowInfo("r", 8, MODEL, free_k=6, free_strong=False)).acceptance == SHORT_MATCH_ACCEPTANCE
    assert policy.choose([RowInfo("r", 8, MODEL, free_k=6, free_strong=False)]) == [0]
    assert policy.choose([RowInfo("r", 8, MODEL, free_k=6)])[0] > 0 and policy.free == [True]
    # a verification almost as cheap as a plain step (a GPU): the short match is worth drafting
    cheap = SpeculationPolicy(cost_model(0.035, per_token=0.0005, per_forward=0.03))
    assert cheap.choose([RowInfo("r", 8, MODEL, free_k=6, free_strong=False)])[0] > 0 and cheap.free == [True]


def test_prompt_lookup_says_whether_its_longest_ngram_matched():
    from fly_serve.drafting.drafters import PromptLookup

    lookup = PromptLookup(min_n=2)
    assert lookup.strong([1, 2, 3, 4, 9, 1, 2, 3, 4])  # the last 4 tokens occurred before
    assert not lookup.strong([1, 2, 3, 4, 9, 7, 2, 3, 4])  # only 3 of them
    assert lookup.propose([1, 2, 3, 4, 9, 7, 2, 3, 4], 2) == [9, 7]  # which still proposes
    # a row's tokens by key (the engine's path): its index answers the same
    from fly_serve.contracts import RowTokens

    row = [1, 2, 3, 4, 9, 7, 2, 3, 4]
    assert not lookup.strong(RowTokens(row, final=len(row), key="r"))
    row += [9, 7, 2, 3, 4]  # now 7 2 3 4 occurred before
    assert lookup.strong(RowTokens(row, final=len(row), key="r"))


# ---- a lookup offer priced by its match (lookup_match.py)
# The widths of the 2-core CPU's target (the cost profile measured there, seconds by tokens in the
# forward): a token costs less the wider the forward, 64 tokens ~24x one.
CPU_WIDTHS = CostProfile([1, 2, 4, 8, 16, 32, 64, 128], [0.033, 0.058, 0.098, 0.197, 0.258, 0.438, 0.779, 1.561])


def test_prompt_lookup_finds_its_match_and_measures_how_far_back_it_agrees():
    from fly_serve.contracts import RowTokens
    from fly_serve.drafting import prompt_lookup
    from fly_serve.drafting.drafters import PromptLookup

    copied = list(range(100, 140))
    seq = [1, 2] + copied + [7, 8] + copied[:20]  # a copy of 20 tokens under way
    end = prompt_lookup.find(seq, 4, 2)
    assert seq[end + 1] == copied[20]  # the token after the occurrence is the copy's next
    assert prompt_lookup.match_length(seq, end, 64) == 20
    assert prompt_lookup.match_length(seq, end, 8) == 8  # read no further back than the cap
    lookup = PromptLookup(min_n=2)
    for tokens in (seq, RowTokens(seq, final=len(seq), key="r")):  # the scan and the row's index
        assert lookup.offer(tokens, 5, 64) == (copied[20:25], 20)
        assert lookup.propose(tokens, 5) == copied[20:25]
    # a 2-token match: an offer, and a match of 2
    assert lookup.offer([5, 6, 9, 9, 9, 1, 5, 6], 2, 64) == ([9, 9], 2)
    assert lookup.offer([5, 6, 9], 3, 64) == ([], 0)  # nothing matches
    assert lookup.offer(seq, 0, 64) == ([], 0)


def test_a_match_prices_its_offer_and_only_a_copy_under_way_goes_past_k_max():
    from fly_serve.k_auto.lookup_match import COPY_K, LONG_MATCH, match_prior, offer_width

    assert match_prior(3) is None and match_prior(15) is None  # the row's own prior
    assert match_prior(16) < match_prior(LONG_MATCH) < 1
    assert offer_width(15, 200, LONG_MATCH - 1) == 15
    assert offer_width(15, 200, LONG_MATCH) == COPY_K
    assert offer_width(15, 40, LONG_MATCH) == 40  # within the row's room
    assert offer_width(15, 10, LONG_MATCH) == 15  # never below k (the row's room already cut it)


def test_a_copy_under_way_drafts_wide_and_a_row_whose_copies_broke_does_not():
    """On the CPU's widths a copy after a long match is drafted in one wide forward (its tokens
    cheapest there), where the same offer without its match's length is left to plain decoding;
    a row whose lookups were rejected again and again prices its next copy by that record."""
    policy = SpeculationPolicy()
    policy.set_profile(CPU_WIDTHS, measured_here=True)
    copy = RowInfo("r", 15, MODEL, free_k=63, free_match=40)
    ks = policy.choose([copy])
    assert policy.free == [True] and ks[0] > 15  # past k_max: the plan's own choice of width
    assert policy.choose([RowInfo("r", 15, MODEL, free_k=63, free_match=0)]) == [0]  # the prior 0.7 alone
    assert policy.choose([RowInfo("r", 15, MODEL, free_k=63, free_match=20)])[0] > 0  # 16-31: priced 0.98
    for _ in range(6):  # copies that broke at their first draft
        policy.tracker.observe(free_key("r"), drafted=30, kept=0)
    assert policy._as_free(copy).acceptance < 0.5
    assert policy.choose([copy]) == [0]


def test_a_copy_in_a_batch_pays_for_the_rows_it_widens():
    """In a batch the target verifies every row padded to the widest: a copy's width is priced on
    all of them, so beside rows that draft nothing it goes less wide than alone."""
    table = BatchVerify(
        [1, 2, 4, 8],
        [1, 2, 4, 8, 16, 32, 64],
        [[s * b**0.9 for s in (0.033, 0.058, 0.098, 0.197, 0.258, 0.438, 0.779)] for b in (1, 2, 4, 8)],
    )
    profile = replace(CPU_WIDTHS, verify_batch=table)
    alone, batch = SpeculationPolicy(), SpeculationPolicy()
    for p in (alone, batch):
        p.set_profile(profile, measured_here=True)
    copy = RowInfo("c", 15, MODEL, free_k=63, free_match=40)
    k_alone = alone.choose([copy])[0]
    k_batch = batch.choose([copy] + [RowInfo(f"p{i}", 15, MODEL) for i in range(7)])
    assert k_alone > 15 and k_batch[0] < k_alone and k_batch[1:] == [0] * 7


def test_the_engine_drafts_a_copy_under_way_past_k_max_and_keeps_the_targets_text(tiny_pair):
    """A text that copies itself (the tiny model's greedy text falls into a loop, a long match):
    on the CPU's widths the engine offers the copy past k_max, the plan drafts it in wide rounds,
    and strict FLy's text is still the target's own greedy text."""
    profile = replace(CPU_WIDTHS, draft_per_forward=0.025)  # a drafter forward ~0.75 of a step: not worth it
    engine = tiny_auto_engine(tiny_pair, profile)
    prompt = "abc def ghi abc def ghi abc def ghi abc def ghi abc def"
    params = dict(mode="fly", theta=1.0, k="auto", k_max=4, max_tokens=160, temperature=0.0)
    req = engine.add(prompt, params)
    widest = 0
    while not req.finished:
        before = req.stats.drafted
        engine.step()
        widest = max(widest, req.stats.drafted - before)
    ar = engine.generate([prompt], dict(params, mode="ar"))[0]
    assert req.generated == ar.generated
    assert widest > 4  # a copy drafted past k_max


def test_a_drafting_plan_pays_back_the_drafters_catch_up_within_the_rows_remaining_tokens():
    """Model drafts for a row the drafter has not seen make it prefill those tokens first
    (RowInfo.drafter_lag), which the plan does not price: where the plan saves less over the
    tokens the rows may still emit than that prefill costs, they decode plainly this round; a
    saving that pays it, no lag, or a remaining not known (0) keep the plan."""
    cost = cost_model(0.03, per_token=0.0002, per_forward=0.004)  # a draft at 0.3 gains a little

    def ks(lag, remaining, n=1):
        rows = [RowInfo(f"r{i}", 8, MODEL, acceptance=0.3, drafter_lag=lag, remaining=remaining) for i in range(n)]
        return SpeculationPolicy(cost).choose(rows)

    drafting = ks(0, 20)
    assert drafting[0] > 0 and ks(0, 0) == drafting  # no lag: as planned
    assert ks(2000, 10) == [0]  # a 2,000-token prefill (57 ms here) for 10 tokens saving 37 ms: plain
    assert ks(2000, 100_000) == drafting  # the same prefill over a long answer pays
    assert ks(2000, 0) == drafting  # remaining not known: as planned
    assert ks(2000, 10, n=4) == [0] * 4  # a batch: its rows remaining together, their lags together
