"""k: auto -- acceptance per row, round cost, and the allocation against brute force (no speed asserted)."""

import itertools

import numpy as np
import pytest
import yaml

from fly_serve.speculation_policy import (
    MODEL,
    NONE,
    PLD,
    AcceptanceTracker,
    RoundCostModel,
    RowInfo,
    SpeculationPolicy,
    allocate,
    expected_emitted,
    min_confidence_for,
    plan,
)


def cost_model(verify_at_1=0.02, per_token=0.0, per_forward=0.0, per_row_forward=0.0, per_round=0.0):
    """A linear verify (seconds at one token, plus per extra token) and the draft coefficients."""
    return RoundCostModel(
        {
            "verify": {"tokens": [1, 101], "seconds": [verify_at_1, verify_at_1 + 100 * per_token]},
            "draft": {"per_round": per_round, "per_forward": per_forward, "per_row_forward": per_row_forward},
        }
    )


def rate(ks, rows, cost) -> float:
    return sum(expected_emitted(k, r.acceptance) for k, r in zip(ks, rows)) / cost.round_s(ks, rows)


def brute_force(rows, cost) -> float:
    caps = [0 if r.drafter == NONE else r.k_max for r in rows]
    choices = [[cap] if r.fixed else range(cap + 1) for cap, r in zip(caps, rows)]
    return max(rate(ks, rows, cost) for ks in itertools.product(*choices))


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


def test_tracker_prior_pool_forget_and_drift_back():
    tracker = AcceptanceTracker(prior=0.5)
    assert tracker.estimate("new") == pytest.approx(0.5)
    rng = np.random.default_rng(2)
    for _ in range(50):
        rounds = [simulate_round(rng, 0.9, 10), simulate_round(rng, 0.9, 10), simulate_round(rng, 0.1, 10)]
        tracker.observe_round(["a", "b", "bad"], [n for n, _ in rounds], [m for _, m in rounds])
    pool = tracker.pool_mean()
    assert 0.7 < pool < 0.95  # mostly the two good rows' drafts
    assert tracker.estimate("never seen") == pytest.approx(pool)
    assert tracker.estimate("bad") < 0.3
    # The bad row is left at k = 0: its evidence ages and it drifts back to the pool mean.
    for _ in range(60):
        rounds = [simulate_round(rng, 0.9, 10), simulate_round(rng, 0.9, 10), (0, 0)]
        tracker.observe_round(["a", "b", "bad"], [n for n, _ in rounds], [m for _, m in rounds])
    assert tracker.estimate("bad") > 0.7
    tracker.forget("a")
    tracker.forget("missing")
    assert set(tracker.rows) == {"b", "bad"}


def test_tracker_tokens_per_forward():
    tracker = AcceptanceTracker()
    assert tracker.tokens_per_forward("x") == 1.0
    for _ in range(30):
        tracker.observe("x", drafted=12, kept=6, forwards=4)
    assert tracker.tokens_per_forward("x") == pytest.approx(3.0, rel=0.05)


# ---- RoundCostModel
def test_cost_model_recovers_linear_coefficients():
    rng = np.random.default_rng(3)
    cost = RoundCostModel()  # the default profile: wrong scale, wrong shape
    verify = lambda n: 0.02 + 0.0004 * n
    draft = lambda f, rf: 0.001 + 0.01 * f + 0.002 * rf
    for _ in range(300):
        rows, forwards = int(rng.integers(1, 9)), int(rng.integers(1, 17))
        row_forwards = rows * forwards - int(rng.integers(0, rows))
        n = int(rng.integers(8, 513))
        noise = rng.normal(1, 0.02, size=2)
        cost.observe_round(
            rows, forwards, n, draft(forwards, row_forwards) * noise[0], verify(n) * noise[1], row_forwards=row_forwards
        )
    for n in (16, 64, 256, 512):
        assert cost.verify_s(n) == pytest.approx(verify(n), rel=0.03)
    e, c, d = cost.draft_coefficients
    assert c == pytest.approx(0.01, rel=0.1) and d == pytest.approx(0.002, rel=0.1)
    for f, rf in ((1, 1), (4, 20), (16, 100)):
        assert cost.draft_s(f, rf) == pytest.approx(draft(f, rf), rel=0.03)
    assert cost.draft_s(0, 0) == 0.0


def test_cost_model_rescales_a_profile_from_one_operating_point():
    profile = {
        "verify": {"tokens": [1, 64, 512], "seconds": [0.01, 0.012, 0.1]},
        "draft": {"per_round": 0.0, "per_forward": 0.004, "per_row_forward": 0.0005},
    }
    cost = RoundCostModel(profile)
    for _ in range(20):  # this machine is three times slower, seen at one batch shape only
        cost.observe_round(8, 10, 128, 3 * (0.004 * 10 + 0.0005 * 80), 3 * float(RoundCostModel(profile).verify_s(128)))
    for n in (1, 64, 512):
        assert cost.verify_s(n) == pytest.approx(3 * RoundCostModel(profile).verify_s(n), rel=0.1)
    assert cost.draft_s(1, 1) == pytest.approx(3 * 0.0045, rel=0.1)


def test_profile_round_trip():
    rng = np.random.default_rng(4)
    cost = RoundCostModel(
        {
            "verify": {"tokens": [1, 32, 256], "seconds": [0.01, 0.011, 0.05]},
            "draft": {"rows": [1, 2, 4, 8], "seconds": [0.0045, 0.005, 0.006, 0.008]},
        }
    )
    assert cost.draft_coefficients == pytest.approx([0.0, 0.004, 0.0005])
    for _ in range(40):
        n = int(rng.integers(8, 300))
        cost.observe_round(4, 5, n, 0.03 * rng.uniform(0.9, 1.1), 0.01 + 0.0002 * n, other_s=0.001)
    profile = yaml.safe_load(yaml.safe_dump(cost.to_profile()))
    again = RoundCostModel.from_profile(profile)
    n = np.array([0.5, 1, 7, 32, 100, 256, 300, 5000])
    assert np.allclose(again.verify_s(n), cost.verify_s(n), rtol=1e-12)
    assert np.allclose(again.draft_coefficients, cost.draft_coefficients)
    assert again.overhead_s == pytest.approx(cost.overhead_s) and cost.overhead_s > 0
    assert again.to_profile() == profile


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
        RowInfo("c", 32, drafter=PLD, acceptance=0.5),
        RowInfo("d", 5, drafter=NONE, acceptance=0.9),
        RowInfo("e", 4, acceptance=0.6, tokens_per_forward=2.0),
    ]
    assert allocate(rows, cost) == [15, 7, 32, 0, 4]


def test_compute_bound_and_low_acceptance_gives_plain_decoding():
    cost = cost_model(verify_at_1=0.001, per_token=0.01, per_forward=0.002, per_row_forward=0.0005)
    rows = [RowInfo(str(b), 15, acceptance=0.2) for b in range(8)]
    assert allocate(rows, cost) == [0] * 8


def test_higher_acceptance_drafts_more():
    cost = cost_model(verify_at_1=0.02, per_token=0.0004, per_forward=0.004, per_row_forward=0.0005)
    rows = [RowInfo(str(a), 15, acceptance=a) for a in (0.3, 0.5, 0.7, 0.85, 0.95)]
    ks = allocate(rows, cost)
    assert ks == sorted(ks) and ks[0] < ks[-1]


def random_instance(rng, curve: str, mixed: bool = True):
    """B <= 3 rows, k_max <= 4. curve: "linear", "convex" or "any" (non-decreasing) verify(n);
    mixed: model, lookup and non-drafting rows, some with MLA, some fixed."""
    rows = []
    for b in range(int(rng.integers(1, 4))):
        drafter = str(rng.choice([MODEL, MODEL, PLD, NONE])) if mixed else MODEL
        a = float(rng.choice([0.0, 1.0, 0.99])) if rng.random() < 0.15 else float(rng.uniform(0, 1))
        rows.append(
            RowInfo(
                str(b),
                int(rng.integers(0, 5)),
                drafter=drafter,
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
    return rows, RoundCostModel({"verify": {"tokens": tokens.tolist(), "seconds": seconds.tolist()}, "draft": draft})


def gaps(seed, curve, mixed, n=300):
    """Relative shortfall of the allocation's rate from the brute-force optimum, per instance."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows, cost = random_instance(rng, curve, mixed)
        p = plan(rows, cost)
        assert p.tokens / p.seconds == pytest.approx(rate(p.ks, rows, cost), rel=1e-9)
        best = brute_force(rows, cost)
        out.append((best - rate(p.ks, rows, cost)) / best)
    return np.array(out)


@pytest.mark.parametrize("curve, mixed", [("linear", True), ("convex", True), ("convex", False)])
def test_allocation_matches_brute_force(curve, mixed):
    assert gaps(10, curve, mixed).max() <= 1e-9


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
        ks = allocate(rows, cost)
        assert ks[0] > 1
        assert rate(ks, rows, cost) == pytest.approx(brute_force(rows, cost))
    rows = [RowInfo(str(b), 15, acceptance=0.8) for b in range(3)]
    assert min(allocate(rows, cost)) > 0


def test_caps_are_respected():
    rng = np.random.default_rng(5)
    for _ in range(100):
        B = int(rng.integers(1, 65))
        rows = [
            RowInfo(
                str(b),
                int(rng.integers(0, 33)),
                drafter=str(rng.choice([MODEL, PLD, NONE])),
                acceptance=float(rng.uniform(0, 1)),
                tokens_per_forward=float(rng.uniform(1, 3)),
                fixed=bool(rng.random() < 0.1),
            )
            for b in range(B)
        ]
        cost = cost_model(rng.uniform(0.001, 0.05), rng.uniform(0, 0.001), rng.uniform(0, 0.01), rng.uniform(0, 0.001))
        ks = allocate(rows, cost)
        for k, r in zip(ks, rows):
            assert 0 <= k <= (0 if r.drafter == NONE else r.k_max)
            if r.fixed and r.drafter != NONE:
                assert k == r.k_max
    assert allocate([], cost) == []


def test_draft_seconds_charge_a_forward_only_for_raising_the_longest_row():
    cost = cost_model(verify_at_1=0.02, per_token=0.0003, per_forward=0.05, per_row_forward=0.001, per_round=0.002)
    rows = [RowInfo("a", 8), RowInfo("b", 8), RowInfo("c", 8, drafter=PLD)]
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
    ks = allocate(rows, cost)
    assert all(k > 0 for k in ks)
    assert rate(ks, rows, cost) == pytest.approx(brute_force(rows, cost))


def test_a_row_below_the_longest_drafts_at_its_share():
    cost = cost_model(verify_at_1=0.01, per_token=0.0001, per_forward=0.005, per_row_forward=0.0002)
    weak = RowInfo("weak", 8, acceptance=0.5)
    assert allocate([weak], cost) == [0]  # alone it would pay whole forwards
    ks = allocate([RowInfo("strong", 8, acceptance=0.97), weak], cost)
    assert ks[0] > 0 and 0 < ks[1] <= ks[0]


def test_fixed_rows_keep_their_k_and_the_others_adapt():
    cost = cost_model(verify_at_1=0.02, per_token=0.0004, per_forward=0.004, per_row_forward=0.0005)
    rows = [RowInfo("fixed", 15, acceptance=0.2, fixed=True), RowInfo("auto", 15, acceptance=0.8)]
    ks = allocate(rows, cost)
    assert ks[0] == 15
    # The fixed row already runs 15 forwards, so the auto row's drafts cost only its share.
    assert ks[1] >= allocate([RowInfo("auto", 15, acceptance=0.8)], cost)[0]


def test_min_confidence_rule():
    assert min_confidence_for(rate=100.0, marginal_s=0.002) == pytest.approx(0.2)
    assert min_confidence_for(rate=1e6, marginal_s=1.0) == 1.0
    assert min_confidence_for(rate=100.0, marginal_s=0.0) == 0.0
    policy = SpeculationPolicy(cost_model(0.02, 0.0004, 0.004, 0.0005))
    assert policy.min_confidence() == 0.0
    policy.choose([RowInfo("a", 15, acceptance=0.8), RowInfo("b", 15, acceptance=0.6)])
    p = policy.last
    assert policy.min_confidence() == pytest.approx(p.tokens / p.seconds * p.marginal_s)
    assert 0 < policy.min_confidence() < 1


# ---- SpeculationPolicy
def test_policy_learns_rows_and_costs_from_rounds():
    rng = np.random.default_rng(6)
    truth = {"good": 0.9, "poor": 0.2, "lookup": 0.6, "fixed": 0.5}
    kinds = {"good": MODEL, "poor": MODEL, "lookup": PLD, "fixed": MODEL}
    verify = lambda n: 0.02 + 0.0004 * n
    draft = lambda f, rf: 0.003 * f + 0.0004 * rf
    policy = SpeculationPolicy.from_profile(None)
    for _ in range(150):
        rows = [RowInfo(key, 10, drafter=kinds[key], fixed=key == "fixed") for key in truth]
        ks = policy.choose(rows)
        assert ks[3] == 10 and all(0 <= k <= 10 for k in ks)
        rounds = [simulate_round(rng, truth[key], k) for key, k in zip(truth, ks)]
        drafted = [n for n, _ in rounds]
        forwards = max(n for (n, _), key in zip(rounds, truth) if kinds[key] == MODEL)
        row_forwards = sum(n for (n, _), key in zip(rounds, truth) if kinds[key] == MODEL)
        policy.record(
            list(truth),
            drafted,
            [m for _, m in rounds],
            forwards=forwards,
            draft_s=draft(forwards, row_forwards),
            verify_s=verify(sum(n + 1 for n in drafted)),
        )
    assert policy.tracker.estimate("good") == pytest.approx(0.9, abs=0.08)
    assert policy.tracker.estimate("fixed") == pytest.approx(0.5, abs=0.15)
    assert policy.cost.verify_s(40) == pytest.approx(verify(40), rel=0.1)
    ks = policy.choose([RowInfo(key, 10, drafter=kinds[key], fixed=key == "fixed") for key in truth])
    assert ks[0] > ks[1]  # the good row drafts more than the poor one
    policy.release(["good", "poor", "lookup", "fixed"])
    assert policy.tracker.rows == {}
    assert policy.choose([]) == []
