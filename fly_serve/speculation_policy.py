"""Speculation length per row, per round, from measured cost (`k: auto`).

Every round the engine asks for each row's k in 0..k_max; the policy picks the ks that maximize
the round's goodput, expected tokens emitted / predicted seconds of the round (the objective of
SmartSpec, Liu et al. 2024). A row at k = 0 is plain decoding inside the same target forward.

  expected_emitted   tokens a row emits with k drafts at per-token acceptance a (geometric model)
  AcceptanceTracker  per row, the chance a draft is kept (FLy's loose acceptances count as kept)
  RoundCostModel     predicted seconds: drafter forwards + one target forward + the rest of the
                     round; seeded from a profile (what `tune-k` writes), refined from every round
  plan / allocate    the ks of one round (the rule is in plan's docstring)
  min_confidence_for when the drafter should stop a row early
  SpeculationPolicy  what the engine calls: choose, record, release

Draft-time model. The drafter runs one batched forward per drafted position, holding the rows
that still draft. A row drafting k tokens at t tokens per forward (t = 1 without MLA; with MLA a
forward may also confirm a lookup proposal, so t >= 1 is measured per row) is in f = k / t of the
forwards, and the round runs F = ceil(max_b f_b) forwards. So

    draft seconds = e * [F > 0] + c * F + d * sum_b f_b

c is paid once per forward, whatever the number of rows in it; d once per row in a forward; e
once per round that drafts (the catch-up of lagging rows, Python). Raising the longest row's k
adds a forward (c + d); raising a row below it adds only that row's share (d).
"""

import functools
import math
from dataclasses import dataclass

import numpy as np

# How a row drafts: drafter forwards, a model-free source (prompt lookup, the suffix index over
# earlier requests, Token Recycling), not at all. The model-free kinds share one cost model: their
# drafting is free (microseconds, no forward), so a draft costs only its share of the target forward.
MODEL, PLD, SUFFIX, RECYCLE, NONE = "model", "pld", "suffix", "recycle", "none"
FREE_KINDS = (PLD, SUFFIX, RECYCLE)
KINDS = (MODEL, *FREE_KINDS, NONE)
_TINY = 1e-12

# Without a profile: a shape only, in units of one single-token target forward. The fitted scale
# (see _AnchoredFit) turns it into this machine's seconds after a few rounds; `tune-k` measures
# a real profile.
DEFAULT_PROFILE = {
    "verify": {"tokens": [1, 64, 1024], "seconds": [1.0, 2.0, 17.0]},
    "draft": {"per_round": 0.0, "per_forward": 0.1, "per_row_forward": 0.01},
    "overhead_s": 0.0,
}


# ---- tokens a row emits
def expected_emitted(k, a):
    """Expected tokens emitted by a row with k drafts when each draft is kept with probability a,
    independently, until the first rejection: the kept drafts plus the target's own token,
    sum_{i=0..k} a**i = (1 - a**(k+1)) / (1 - a), and k + 1 at a = 1. Works on arrays."""
    k, a = np.asarray(k, dtype=float), np.asarray(a, dtype=float)
    near_one = np.abs(1.0 - a) < 1e-9
    safe = np.where(near_one, 0.5, a)  # keeps the unused branch finite
    out = np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))
    return out if out.ndim else float(out)


# ---- acceptance per row
@dataclass
class _Evidence:
    kept: float = 0.0  # drafts kept (successes), discounted by age
    rejected: float = 0.0  # rounds that ended in a rejection (failures), discounted by age
    drafted: float = 0.0  # drafts and drafter forwards, for tokens_per_forward
    forwards: float = 0.0


class AcceptanceTracker:
    """Per-token acceptance of each row: a Beta posterior mean over its recent rounds.

    A round's kept count stops at the first rejection, so under the geometric model a round that
    drafted n and kept m holds m successes and one failure if m < n, none if m == n (the row ran
    out of drafts, not of luck): the estimate is kept / (kept + rejections), never kept / drafted.
    Evidence decays by `decay` per round so the estimate follows the text (code, then prose);
    rounds without drafts decay it too, so a row the allocator left at k = 0 drifts back to the
    pool mean and is tried again instead of staying written off. The prior of a row is the pool
    mean (all rows' recent evidence), itself anchored to `prior` with `prior_weight` drafts.
    """

    def __init__(self, prior: float = 0.7, prior_weight: float = 2.0, decay: float = 0.9, pool_decay: float = 0.95):
        if not 0 <= prior < 1:
            raise ValueError("prior must be in [0, 1)")
        self.prior, self.prior_weight = prior, prior_weight
        self.decay, self.pool_decay = decay, pool_decay
        self.rows: dict[str, _Evidence] = {}
        self.pool = _Evidence()

    def observe(self, key: str, drafted: int, kept: int, forwards: int | None = None):
        """One round of one row: drafted tokens, kept ones (accepted + loosely accepted), and
        optionally the drafter forwards the row took (for tokens_per_forward)."""
        ev = self.rows.setdefault(key, _Evidence())
        _age(ev, self.decay)  # the pool ages once per round, in observe_round
        for e in (ev, self.pool):
            e.kept += kept
            e.rejected += kept < drafted
            if forwards:
                e.drafted += drafted
                e.forwards += forwards

    def observe_round(self, keys, drafted, kept, forwards=None):
        """Every row of a round at once; ages the pool by one round."""
        _age(self.pool, self.pool_decay)
        forwards = forwards if forwards is not None else [None] * len(keys)
        for key, n, m, f in zip(keys, drafted, kept, forwards):
            self.observe(key, n, m, f)

    def pool_mean(self) -> float:
        p = self.pool
        return (p.kept + self.prior * self.prior_weight) / (p.kept + p.rejected + self.prior_weight)

    def estimate(self, key: str) -> float:
        """Per-token acceptance in [0, 1); a row never seen gets the pool mean."""
        prior = self.pool_mean()
        ev = self.rows.get(key)
        if ev is None:
            return prior
        return (ev.kept + prior * self.prior_weight) / (ev.kept + ev.rejected + self.prior_weight)

    def tokens_per_forward(self, key: str) -> float:
        """Drafts per drafter forward for the row (1 without MLA), with one forward of prior."""
        ev = self.rows.get(key)
        if ev is None or ev.forwards <= 0:
            return 1.0
        return max(1.0, (ev.drafted + 1.0) / (ev.forwards + 1.0))

    def forget(self, key: str):
        self.rows.pop(key, None)


def _age(ev: _Evidence, factor: float):
    ev.kept, ev.rejected = ev.kept * factor, ev.rejected * factor
    ev.drafted, ev.forwards = ev.drafted * factor, ev.forwards * factor


# ---- round cost
class _AnchoredFit:
    """Least squares t ~ phi . theta over a bounded window of recent observations, anchored to
    prior coefficients theta0 as theta = s * theta0 + delta: a Gaussian prior with the scale s
    near 1 within scale_spread (loose: this machine may be much faster or slower than the
    profile's) and each delta_i near 0 within shape_spread of its coefficient (tighter), against
    observations with relative timing noise `noise`. So a few rounds at one operating point
    rescale the prior without bending its shape; rounds spread over many operating points
    reshape it."""

    def __init__(
        self,
        theta0,
        window: int = 64,
        half_life: float = 32.0,
        noise: float = 0.05,
        scale_spread: float = 10.0,
        shape_spread: float = 0.5,
    ):
        self.theta0 = np.asarray(theta0, dtype=float)
        self.theta = self.theta0.copy()
        self.phi = np.zeros((window, len(self.theta0)))  # a ring of the last `window` observations
        self.t = np.zeros(window)
        self.count = 0  # observations so far
        self.half_life, self.noise = half_life, noise
        self.scale_spread, self.shape_spread = scale_spread, shape_spread
        self.scale = 1.0

    def add(self, phi, t: float):
        i = self.count % len(self.t)
        self.phi[i], self.t[i] = phi, t
        self.count += 1
        self._refit()

    def _refit(self):
        window = len(self.t)
        m = min(self.count, window)
        phi, t = self.phi[:m], self.t[:m]
        age = (self.count - 1 - np.arange(m)) % window
        # Relative residuals (timing noise grows with the time); older rounds count less.
        w = 0.5 ** (age / self.half_life) / (np.maximum(np.abs(t), _TINY) * self.noise) ** 2
        # Shape corrections relative to each coefficient at the current scale; a coefficient
        # the prior sets to zero is measured against the mean size of the others.
        size = np.abs(self.theta0)
        sigma = np.where(size > 0, size, max(float(size.mean()), _TINY)) * max(self.scale, 1e-3)
        # Normal equations in u = (s, delta): data, then the prior on s and on each delta.
        x = np.column_stack([phi @ self.theta0, phi])
        lhs = (x * w[:, None]).T @ x
        rhs = (x * w[:, None]).T @ t
        lhs[0, 0] += self.scale_spread**-2
        rhs[0] += self.scale_spread**-2
        lhs[1:, 1:] += np.diag((self.shape_spread * sigma) ** -2.0)
        u = np.linalg.solve(lhs, rhs)
        self.scale = float(u[0])
        self.theta = u[0] * self.theta0 + u[1:]


def _hat(n, knots: np.ndarray):
    """Piecewise-linear interpolation over knots, extended linearly past both ends: returns
    (segment index i, weight w) with value = v[i] * (1 - w) + v[i + 1] * w."""
    n = np.asarray(n, dtype=float)
    i = np.clip(np.searchsorted(knots, n, side="right") - 1, 0, len(knots) - 2)
    return i, (n - knots[i]) / (knots[i + 1] - knots[i])


class RoundCostModel:
    """Predicted seconds of a round = overhead + verify(n) + draft(F, sum f) (module docstring).

    verify(n), n = sum_b (k_b + 1) the tokens in the target forward: piecewise linear over the
    profile's measured token counts (a GPU forward is flat until compute-bound, then linear),
    extended linearly past them, non-decreasing. Every round refits it and the draft
    coefficients (e, c, d) over a bounded window of recent rounds, anchored to the profile.
    """

    def __init__(self, profile: dict | None = None, *, window: int = 64, half_life: float = 32.0):
        profile = profile or DEFAULT_PROFILE
        v = profile.get("verify", DEFAULT_PROFILE["verify"])
        order = np.argsort(np.asarray(v["tokens"], dtype=float))
        self.knots = np.asarray(v["tokens"], dtype=float)[order]
        seconds = np.asarray(v["seconds"], dtype=float)[order]
        if len(self.knots) < 2 or len(np.unique(self.knots)) != len(self.knots):
            raise ValueError("profile verify: needs two or more distinct token counts")
        self._verify = _AnchoredFit(np.maximum.accumulate(seconds), window, half_life)
        self._draft = _AnchoredFit(
            _draft_coefficients(profile.get("draft", DEFAULT_PROFILE["draft"])), window, half_life
        )
        self.overhead_s = float(profile.get("overhead_s", 0.0))
        self._overhead_alpha = 1.0 - 0.5 ** (1.0 / half_life)
        self._refresh()

    def _refresh(self):
        """Cache what predictions read after every fit: the knot values (non-negative and
        non-decreasing: more tokens never verify faster) with one far point past each end, so one
        np.interp call extrapolates the end segments."""
        v = np.maximum.accumulate(np.maximum(self._verify.theta, 0.0))
        k = self.knots
        far = 1e7 * max(k[-1] - k[0], 1.0)
        lo = v[0] - (v[1] - v[0]) / (k[1] - k[0]) * far
        hi = v[-1] + (v[-1] - v[-2]) / (k[-1] - k[-2]) * far
        self._values = v
        self._interp = (np.concatenate([[k[0] - far], k, [k[-1] + far]]), np.concatenate([[lo], v, [hi]]))
        # (e per drafting round, c per forward, d per row per forward), non-negative.
        self.draft_coefficients = np.maximum(self._draft.theta, 0.0)

    @classmethod
    def from_profile(cls, profile: dict, **kw) -> "RoundCostModel":
        return cls(profile, **kw)

    def to_profile(self) -> dict:
        """The current model as a profile (plain floats, YAML-ready); from_profile of it predicts
        the same. The observation window is not kept: the profile is the next run's prior."""
        e, c, d = (float(x) for x in self.draft_coefficients)
        return {
            "verify": {"tokens": [float(x) for x in self.knots], "seconds": [float(x) for x in self._values]},
            "draft": {"per_round": e, "per_forward": c, "per_row_forward": d},
            "overhead_s": float(self.overhead_s),
        }

    # -- predictions
    def verify_s(self, tokens):
        """Seconds of a target forward over `tokens` tokens (all rows together); arrays too."""
        out = np.maximum(np.interp(tokens, *self._interp), 0.0)
        return out if out.ndim else float(out)

    def verify_slope(self, tokens: float) -> float:
        """Seconds the target forward gains per extra token around `tokens`."""
        return float(self.verify_s(tokens + 0.5) - self.verify_s(tokens - 0.5))

    def draft_s(self, forwards, row_forwards):
        e, c, d = self.draft_coefficients
        forwards = np.asarray(forwards, dtype=float)
        out = np.where(forwards > 0, e + c * forwards + d * np.asarray(row_forwards, dtype=float), 0.0)
        return out if out.ndim else float(out)

    def round_s(self, ks, rows) -> float:
        """Predicted seconds of a round in which row b drafts ks[b] (rows: RowInfo)."""
        ks = np.asarray(ks, dtype=float)
        model = np.array([r.drafter == MODEL for r in rows], dtype=bool)
        tpf = np.array([_tpf(r) for r in rows])
        f = np.where(model, ks / tpf, 0.0)
        forwards = math.ceil(float(f.max()) - 1e-9) if len(rows) else 0
        return float(self.overhead_s + self.verify_s(float((ks + 1).sum())) + self.draft_s(forwards, f.sum()))

    # -- learning
    def observe_round(
        self,
        rows: int,
        forwards: int,
        verify_tokens: int,
        draft_s: float,
        verify_s: float,
        *,
        row_forwards: float | None = None,
        other_s: float | None = None,
    ):
        """One measured round. rows: rows the model drafter drafted for; forwards: its batched
        forwards; row_forwards: sum over forwards of the rows in each (default rows * forwards,
        exact when all rows draft the same length); verify_tokens: tokens in the target forward;
        other_s: the rest of the round (decide, commit), if measured."""
        i, w = _hat(float(verify_tokens), self.knots)
        phi = np.zeros(len(self.knots))
        phi[i], phi[i + 1] = 1 - w, w
        self._verify.add(phi, verify_s)
        if forwards > 0:
            rf = rows * forwards if row_forwards is None else row_forwards
            self._draft.add([1.0, float(forwards), float(rf)], draft_s)
        if other_s is not None:
            self.overhead_s += self._overhead_alpha * (other_s - self.overhead_s)
        self._refresh()


def _draft_coefficients(d: dict) -> list[float]:
    """(e, c, d) from a profile's draft entry: coefficients, or measured seconds per forward at
    some numbers of rows ({"rows": [...], "seconds": [...]}) fitted as c + d * rows."""
    if "rows" in d:
        rows, seconds = np.asarray(d["rows"], dtype=float), np.asarray(d["seconds"], dtype=float)
        A = np.column_stack([np.ones_like(rows), rows])
        c, slope = np.linalg.lstsq(A, seconds, rcond=None)[0] if len(np.unique(rows)) > 1 else (seconds.mean(), 0.0)
        return [float(d.get("per_round", 0.0)), max(float(c), 0.0), max(float(slope), 0.0)]
    return [float(d.get("per_round", 0.0)), float(d["per_forward"]), float(d["per_row_forward"])]


# ---- allocation
@dataclass
class RowInfo:
    key: str
    k_max: int  # the request's cap (and what room is left in max_tokens / the context)
    drafter: str = MODEL  # one of KINDS
    acceptance: float | None = None  # None: the policy's tracker fills it
    tokens_per_forward: float | None = None  # drafts per drafter forward; None: tracker / 1
    fixed: bool = False  # k is k_max (a request with a fixed k); the others adapt around it

    def __post_init__(self):
        if self.drafter not in KINDS:
            raise ValueError(f"drafter: must be one of {', '.join(KINDS)} (got {self.drafter!r})")


def _tpf(r: RowInfo) -> float:
    return max(r.tokens_per_forward or 1.0, 1e-3)


@dataclass
class Plan:
    ks: list[int]
    tokens: float  # expected tokens emitted by the round
    seconds: float  # predicted seconds of the round
    forwards: int = 0  # drafter forwards
    marginal_s: float = 0.0  # seconds one more draft of a row below the longest would add

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


def plan(rows: list[RowInfo], cost: RoundCostModel, max_iter: int = 12) -> Plan:
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
    """
    B = len(rows)
    if B == 0:
        return Plan([], 0.0, 0.0)
    cols = [
        (0 if r.drafter == NONE else max(int(r.k_max), 0), r.acceptance or 0.0, r.drafter == MODEL, _tpf(r), r.fixed)
        for r in rows
    ]
    cap, a, model, tpf, fixed = (np.array(x) for x in zip(*cols))
    a = np.minimum(np.maximum(a.astype(float), 0.0), 1.0)
    e, c, d = (float(x) for x in cost.draft_coefficients)
    per_forward = np.where(model, 1.0 / tpf, 0.0)  # drafter forwards per draft of the row
    d_row = d * per_forward  # drafter seconds per draft of the row
    floor = np.where(fixed, cap, 0)  # a fixed row drafts its k_max

    # Tables: sum_{j<=m} a**j (drafts kept in expectation) by row and m; verify by drafts.
    K = int(cap.max())
    flat = (np.cumsum(a[:, None] ** np.arange(K + 1), axis=1) - 1.0).ravel()
    base = np.arange(B) * (K + 1)
    verify = cost.verify_s(np.arange(B, B + int(cap.sum()) + 2, dtype=float))
    slope = np.diff(verify)
    # a**j > x  <=>  j < log(x) / log(a); a = 1 gets a tiny negative log (every draft is kept).
    inv_log_a = 1.0 / np.log(np.minimum(np.maximum(a, 1e-300), 1.0 - 1e-15))

    # Levels: the drafter forwards L, and how far each row may draft under each (a row without
    # drafter forwards is not limited: the + K + 1).
    need = np.ceil(cap * per_forward - 1e-9)
    low = int((need * fixed).max())
    levels = np.arange(low, int(need.max()) + 1)
    unlimited = np.where(model, 0, K + 1)
    limit = np.minimum(np.floor(levels[:, None] * tpf + 1e-9) + unlimited, cap).astype(int)  # [L, B]

    def rate_of(k):
        """Exact tokens / seconds of allocations k [..., B] -> (rate, seconds) [...]."""
        f = k * per_forward
        forwards = np.ceil(f.max(-1) - 1e-9)
        seconds = cost.overhead_s + verify[k.sum(-1)] + (e + c * forwards) * (forwards > 0) + d * f.sum(-1)
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
        # The target's seconds per draft, either side of the current token count and between.
        n = int(ks.sum())
        s = slope[[max(n - 1, 0), n]]
        s = np.array([s[0], s[1], s.mean()])
        # Drafts worth their seconds at rate lam: a**j > x, x = lam * seconds per draft.
        cost_row = lam * (s[:, None] + d_row)  # [S, B]
        worth = np.ceil(np.log(np.maximum(cost_row, 1e-300)) * inv_log_a) - 1
        worth = np.minimum(np.maximum(worth, floor), cap).astype(int)
        # Under each level, each row up to its limit (levels above the longest row add nothing),
        # every candidate costed exactly.
        top = math.ceil(float((worth * per_forward).max()) - 1e-9)
        rate, k = best_of(np.minimum(worth[:, None, :], limit[: max(top - low, 0) + 1]).reshape(-1, B))
        if rate <= lam * (1 + 1e-12):
            # The greedy's own moves, one draft more or one less for a row: they climb to a kink
            # of a curved verify(n) that the thresholds jump over.
            rate, k = best_of(np.minimum(np.maximum(ks + _steps(B), floor), cap))
            if rate <= lam * (1 + 1e-12):
                break  # nothing beats lam: with linear costs, lam is the optimum
        lam, ks = rate, k
    rate, seconds = (float(x) for x in rate_of(ks))
    return Plan(
        ks=ks.tolist(),
        tokens=rate * seconds,
        seconds=seconds,
        forwards=math.ceil(float((ks * per_forward).max()) - 1e-9),
        marginal_s=float(slope[int(ks.sum())]) + d,
    )


@functools.lru_cache(maxsize=8)
def _steps(B: int) -> np.ndarray:
    """Every single-row step of an allocation of B rows: +1 for one row, then -1 for one row."""
    steps = np.concatenate([np.eye(B, dtype=int), -np.eye(B, dtype=int)])
    steps.flags.writeable = False
    return steps


def allocate(rows: list[RowInfo], cost: RoundCostModel) -> list[int]:
    """Each row's k for this round; see plan."""
    return plan(rows, cost).ks


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


# ---- what the engine calls
class SpeculationPolicy:
    """Chooses every auto row's k each round and learns from what the round did.

    choose(rows) -> ks: rows with fixed=True keep k_max but still share the round (their drafts
    and forwards are paid before the others are chosen). record(...) after the round. release(keys)
    when requests leave, so memory stays bounded by the running batch.
    """

    def __init__(self, cost: RoundCostModel | None = None, tracker: AcceptanceTracker | None = None):
        self.cost = cost or RoundCostModel()
        self.tracker = tracker or AcceptanceTracker()
        self.last: Plan | None = None  # the plan of the round last chosen
        self._rows: dict[str, RowInfo] = {}  # that round's rows, for record

    @classmethod
    def from_profile(cls, profile: dict | None, **tracker_kw) -> "SpeculationPolicy":
        return cls(RoundCostModel(profile), AcceptanceTracker(**tracker_kw))

    def choose(self, rows: list[RowInfo]) -> list[int]:
        """Every row's k for this round; a row's unset acceptance and tokens per forward come
        from what its earlier rounds showed."""
        tracker = self.tracker
        rows = [
            RowInfo(
                r.key,
                r.k_max,
                r.drafter,
                tracker.estimate(r.key) if r.acceptance is None else r.acceptance,
                r.tokens_per_forward or tracker.tokens_per_forward(r.key),
                r.fixed,
            )
            for r in rows
        ]
        self._rows = {r.key: r for r in rows}
        self.last = plan(rows, self.cost)
        return self.last.ks

    def min_confidence(self) -> float:
        """The drafter's stop threshold for the round last chosen (see min_confidence_for)."""
        if self.last is None or not self.last.ks:
            return 0.0
        return min_confidence_for(self.last.rate, self.last.marginal_s)

    def record(
        self,
        keys: list[str],
        drafted: list[int],
        kept: list[int],
        *,
        draft_s: float,
        verify_s: float,
        forwards: int = 0,
        row_forwards: float | None = None,
        other_s: float | None = None,
        row_draft_forwards: list[int] | None = None,
    ):
        """One finished round. keys, drafted, kept (accepted + loosely accepted) per row, in any
        order; forwards: the model drafter's forwards this round; row_draft_forwards: per row, the
        drafter forwards it took (measures MLA's tokens per forward), if the drafter reports it."""
        drafting = [(k, n) for k, n in zip(keys, drafted) if n > 0 and self._kind(k) == MODEL]
        if row_forwards is None and forwards > 0:
            # Without MLA a row is in one forward per draft; with it, in about n / t of them.
            row_forwards = sum(min(forwards, math.ceil(n / self._tpf(k) - 1e-9)) for k, n in drafting)
        self.cost.observe_round(
            len(drafting),
            forwards,
            sum(n + 1 for n in drafted),
            draft_s,
            verify_s,
            row_forwards=row_forwards,
            other_s=other_s,
        )
        self.tracker.observe_round(keys, drafted, kept, row_draft_forwards)

    def release(self, keys):
        for key in keys:
            self.tracker.forget(key)
            self._rows.pop(key, None)

    def _kind(self, key: str) -> str:
        r = self._rows.get(key)
        return r.drafter if r is not None else MODEL

    def _tpf(self, key: str) -> float:
        r = self._rows.get(key)
        return _tpf(r) if r is not None else 1.0
