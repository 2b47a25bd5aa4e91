"""The ks of one round (k "auto"): each row's drafts for the most expected tokens per predicted
second of the round (the objective of SmartSpec, Liu et al. 2024). A row at k = 0 is plain
decoding inside the same target forward.

  RowInfo             what the allocator knows of a row (limit, source, acceptance, MLA)
  plan                the ks of one round (the rule is in its docstring)
  min_confidence_for  when the drafter should stop a row early
"""

import functools
import math
from dataclasses import dataclass

import numpy as np

from .round_cost import KINDS, MODEL, NONE, RoundCostModel, hit_chance, overlapped_s, tokens_per_forward

_TINY = 1e-12


@dataclass
class RowInfo:
    key: str
    limit: int  # the most drafts this round: the request's k (or k_max under k auto), cut to the room left
    source: str = MODEL  # what drafts the row: one of KINDS
    acceptance: float | None = None  # None: the policy's tracker fills it
    tokens_per_forward: float | None = None  # drafts per drafter forward; None: tracker / 1
    fixed: bool = False  # k is limit (a request with a fixed k); the others adapt around it
    # A model row's alternative this round: the drafts its model-free sources propose (no
    # drafter forward); 0: none (speculation_policy.choose weighs them against the model's)
    free_k: int = 0
    # Whether those drafts follow a match of prompt lookup's longest n-gram (or come from another
    # source): only such an offer is probed (speculation_policy._free_probes)
    free_strong: bool = True
    # How far back the lookup's match agrees with the row's text (prompt_lookup.match_length; 0:
    # not a lookup, or not measured): the prior its drafts are priced from (lookup_match.py)
    free_match: int = 0
    # Tokens the model drafter must prefill before it can draft this row (it has not drafted
    # since these were committed): what a probe of a row left at k = 0 pays first
    drafter_lag: int = 0
    # Tokens the request may still emit (0: not known): what a drafting plan has to pay that
    # catch-up back within (speculation_policy._catch_up_paid)
    remaining: int = 0
    # A model row's drafter by name (None: the engine's default), and the drafters k auto may
    # choose it among (speculation_policy.choose: by the row's acceptance with each, each one's
    # cost and its catch-up); (): no choice. drafter_lags: drafter_lag of each of `drafters`, in
    # their order (each has seen the row up to its own last draft)
    drafter: str | None = None
    drafters: tuple[str, ...] = ()
    drafter_lags: tuple[int, ...] = ()

    def __post_init__(self):
        if self.source not in KINDS:
            raise ValueError(f"source: must be one of {', '.join(KINDS)} (got {self.source!r})")


@dataclass
class Plan:
    ks: list[int]
    tokens: float  # expected tokens emitted by the round
    seconds: float  # predicted seconds of the round
    forwards: int = 0  # drafter forwards
    marginal_s: float = 0.0  # seconds one more draft of a row adds (padded forward: its share of a wider one)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


def plan(rows: list[RowInfo], cost: RoundCostModel, max_iter: int = 12, overlap: bool = False) -> Plan:
    """The ks maximizing expected tokens / predicted seconds of the round.

    The greedy by marginal tokens per marginal second starts every row at k = 0, adds the
    increment (row b's next draft j) with the best ratio of its tokens, a_b**j (the chance that
    it and the drafts before it are kept), to its seconds, and stops when the next one would
    lower the round's tokens / second. Where it stops it holds exactly the increments whose ratio
    beats the round's rate. This computes that fixed point directly (Dinkelbach's iteration for a
    ratio): at a rate lam, row b takes the drafts with a_b**j > lam * (its seconds per draft), a
    count that is a logarithm since a_b**j is geometric; the best such allocation's rate is the
    next lam, until no allocation beats lam. With linear costs that is the optimum.

    The drafter's per-forward cost c is shared, so the candidates are made for every number L of
    drafter forwards: under L a model row drafts at most L * t_b (t_b its tokens per forward) and
    the round pays c * L. The best L wins, so a row that would raise the number of forwards is
    charged a whole forward, and a row below it only its share. A greedy over single increments
    alone would miss that: no row by itself may pay for the first forward that all rows together
    pay for.

    The target's seconds per draft come from the cost model's curve around the current token
    count; every candidate is costed exactly on the curve. Where no threshold allocation beats lam
    (a kink of a curved verify(n) that the thresholds jump over), the greedy's own single steps,
    one draft more or one less for one row, are tried before stopping. Exact on brute force for
    linear and convex verify(n); on a non-convex one it may stop at a local optimum.

    With the profile's batch table the target's forward is [B, max k + 1] (round_cost.py), so the
    verification is shared like the drafter's forwards: the candidates are also made for every
    width W (each row up to W, under each drafter level), a row below the widest verifies for
    free, and widening costs the step of all B rows (exact on brute force for any table that
    never falls). The objective stays the batch's tokens per second.

    overlap: draft-ahead's round cost (round_cost.py): max(draft, verify) plus the lost bets'
    drafting. The candidates are costed exactly by it, so the uniform start finds the k where
    drafting meets verification.
    """
    B = len(rows)
    if B == 0:
        return Plan([], 0.0, 0.0)
    cols = [
        (
            0 if r.source == NONE else max(int(r.limit), 0),
            r.acceptance or 0.0,
            r.source == MODEL,
            tokens_per_forward(r),
            r.fixed,
        )
        for r in rows
    ]
    cap, a, model, tpf, fixed = (np.array(x) for x in zip(*cols))
    a = np.minimum(np.maximum(a.astype(float), 0.0), 1.0)
    e, c, d = (float(x) for x in cost.draft_coefficients)
    per_forward = np.where(model, 1.0 / tpf, 0.0)  # drafter forwards per draft of the row
    d_row = d * per_forward  # drafter seconds per draft of the row
    floor = np.where(fixed, cap, 0)  # a fixed row drafts its limit

    # Tables: sum_{j<=m} a**j (drafts kept in expectation) by row and m; verify by drafts.
    K = int(cap.max())
    flat = (np.cumsum(a[:, None] ** np.arange(K + 1), axis=1) - 1.0).ravel()
    base = np.arange(B) * (K + 1)
    slope = _verify_per_draft(cost, B, int(cap.sum()), K)
    # a**j > x  <=>  j < log(x) / log(a); a = 1 gets a tiny negative log (every draft is kept).
    inv_log_a = 1.0 / np.log(np.minimum(np.maximum(a, 1e-300), 1.0 - 1e-15))

    # Levels: the drafter forwards L, and how far each row may draft under each (a row without
    # drafter forwards is not limited: the + K + 1).
    need = np.ceil(cap * per_forward - 1e-9)
    low = int((need * fixed).max())
    levels = np.arange(low, int(need.max()) + 1)
    unlimited = np.where(model, 0, K + 1)
    limit = np.minimum(np.floor(levels[:, None] * tpf + 1e-9) + unlimited, cap).astype(int)  # [L, B]
    # Widths: the target verifies [B, max k + 1] (rows padded to the widest), so under a width W
    # every row may draft up to W for free in the target; candidates for every level and W.
    # (Priced by total tokens, no width is special: the caps alone.)
    widths = np.minimum(np.arange(int(floor.max()) if cost.batched else K, K + 1)[:, None], cap)  # [W, B]

    def rate_of(k):
        """Exact tokens / seconds of allocations k [..., B] -> (rate, seconds) [...]."""
        f = k * per_forward
        forwards = np.ceil(f.max(-1) - 1e-9)
        shared = (e + c * forwards) * (forwards > 0)
        if overlap:
            peek = (c + d * (model & (k > 0)).sum(-1)) * (forwards > 0)
            work = overlapped_s(cost.verify_round_s(k), shared, d * f, hit_chance(k, a, model), peek)
            seconds = cost.overhead_s + work
        else:
            seconds = cost.overhead_s + cost.verify_round_s(k) + shared + d * f.sum(-1)
        return (B + flat[base + k].sum(-1)) / np.maximum(seconds, _TINY), seconds

    def best_of(k):
        """The best of candidate allocations k [N, B]: (rate, allocation)."""
        rates = rate_of(k)[0]
        i = int(np.argmax(rates))
        return float(rates[i]), k[i]

    # Start from the best uniform allocation (every row at min(j, its cap), j = 0..K): a verify(n)
    # that jumps before it flattens (a CPU's one-token forward takes a faster kernel than a
    # two-token one) makes every single first draft a loss while k = 7 is a gain; the threshold
    # iteration alone would stay at k = 0, a local optimum.
    lam, ks = best_of(np.maximum(np.minimum(np.arange(K + 1)[:, None], cap), floor))
    for _ in range(max_iter):
        # The target's seconds per draft, either side of the current operating point and between;
        # 0: a draft below the widest row (free in a padded forward).
        n = int(ks.max()) if cost.batched else int(ks.sum())
        s = slope[[max(n - 1, 0), n]]
        s = np.array([s[0], s[1], s.mean(), 0.0])
        # Drafts worth their seconds at rate lam: a**j > x, x = lam * seconds per draft.
        cost_row = lam * (s[:, None] + d_row)  # [S, B]
        worth = np.ceil(np.log(np.maximum(cost_row, 1e-300)) * inv_log_a) - 1
        worth = np.minimum(np.maximum(worth, floor), cap).astype(int)
        # Under each level, each row up to its limit (levels above the longest row add nothing),
        # every candidate costed exactly.
        top = math.ceil(float((worth * per_forward).max()) - 1e-9)
        under = np.minimum(limit[: max(top - low, 0) + 1, None], widths[None]).reshape(-1, B)  # [L * W, B]
        rate, k = best_of(np.minimum(worth[:, None, :], under).reshape(-1, B))
        if rate <= lam * (1 + 1e-12):
            # The greedy's own moves, one draft more or one less for a row: they climb to a kink
            # of a curved verify(n) that the thresholds jump over.
            rate, k = best_of(np.minimum(np.maximum(ks + _steps(B), floor), cap))
            if rate <= lam * (1 + 1e-12):
                # Two drafts more or less: one more can cross into a drafter forward that only a
                # second fills (a step that loses where the pair gains).
                rate, k = best_of(np.minimum(np.maximum(ks + 2 * _steps(B), floor), cap))
            if rate <= lam * (1 + 1e-12):
                break  # nothing beats lam: with linear costs, lam is the optimum
        lam, ks = rate, k
    rate, seconds = (float(x) for x in rate_of(ks))
    return Plan(
        ks=ks.tolist(),
        tokens=rate * seconds,
        seconds=seconds,
        forwards=math.ceil(float((ks * per_forward).max()) - 1e-9),
        marginal_s=float(slope[int(ks.max() if cost.batched else ks.sum())]) + d,
    )


def _verify_per_draft(cost: RoundCostModel, B: int, drafts: int, K: int) -> np.ndarray:
    """The target's seconds per draft around each operating point: by total drafts n (index n,
    the step from n to n + 1 drafts) on the one-row curve; with the batch table, by the widest
    row's k (index k, the step of widening every row from k + 1 to k + 2 tokens, shared by the B
    rows: one row's share of it)."""
    if cost.batched:
        return np.diff(cost.verify_width_s(B, np.arange(1, K + 3, dtype=float))) / B
    return np.diff(cost.verify_s(np.arange(B, B + drafts + 2, dtype=float)))


@functools.lru_cache(maxsize=8)
def _steps(B: int) -> np.ndarray:
    """Every single-row step of an allocation of B rows: +1 for one row, then -1 for one row."""
    steps = np.concatenate([np.eye(B, dtype=int), -np.eye(B, dtype=int)])
    steps.flags.writeable = False
    return steps


def min_confidence_for(rate: float, marginal_s: float) -> float:
    """The drafter's confidence below which drafting a row further does not pay.

    A draft adds to the round's output the chance that it is kept (it and the drafts before it),
    and costs marginal_s seconds, in which the round earns rate * marginal_s tokens on average
    (rate: the plan's tokens per second). So the draft pays only if its chance to be kept is at
    least rate * marginal_s, the same test the allocator applies with a**j. The drafter's own
    probability stands in for that chance: best the product of its probabilities over the row's
    drafts so far this round; its latest token's probability alone is a looser test (it drafts
    more). With FLy the target also keeps some drafts it disagrees with, so the drafter's
    probability understates the chance and the rule errs toward stopping a little early.
    """
    return min(1.0, max(0.0, rate * marginal_s))
