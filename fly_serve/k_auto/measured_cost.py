"""The frozen cost profile against the rounds the engine really runs. The round cost model is
frozen (round_cost.py) so that a plan never chases wall-clock noise; what it measures is read here,
in two ways, and only where a reading changes the plan.

CostCheck: the profile's shape. A profile measured on another machine, or the default
shape of an uncalibrated engine, would stay wrong for the engine's life: a model that overprices
drafts plans k = 0 and never sees a round that would show otherwise. The policy's probes run
drafting rounds now and then; every round's measured seconds are compared with the model's
prediction at that operating point (the target forward as the model prices it: its tokens, or its
shape (rows, tokens per row) with a batch table). Only the shape counts: a machine uniformly slower
or faster scales every prediction alike and leaves the plan unchanged. The profile is replaced when
measured / predicted differs between operating points by more than `tolerance`, each point the
median of its last `window` rounds and at least `min_rounds` of them.

UnderLoad: rounds of two rows or more. The profile is timed on an idle host, each part alone; under
load a served drafter shares the cores with the streaming of the round before and catches up the
tokens it accepted, so it costs more than it timed relative to the target (docs/journal.md,
"k auto under load"). Three things are read from live rounds, each the median of a window:
- the drafter against the target of the same round: (drafting seconds / predicted) / (verification
  seconds / predicted), so a drift of the host's speed slows both halves alike and cancels;
- the price of width: with a batch table the target is base(B) + beta x (table(B, T) - base(B)),
  base(B) the one-token forward of B rows; beta comes from pairs of consecutive rounds of the same
  row count and different widths (seconds apart, the host's speed is the same), clipped to
  [1/4, 4]. The plan keeps one width in steady state, so the policy steps it now and then;
- a drafting round's fixed price: where a pair's drafting calls ran different numbers of forwards,
  their difference over the difference the profile predicts is the drafter's slope, and the rest of
  each drafting round its fixed price (the first forward after a round shares the cores with that
  round's streaming). Until pairs come, one ratio prices the drafter.
A row alone keeps the frozen profile (SpeculationPolicy.cost_for), so a greedy request sent alone
gets the same plan every time; under load a batch's text already depends on its other rows.
"""

import statistics
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from .round_cost import BatchVerify, CostProfile, RoundCostModel

Point = int | tuple[int, int]  # tokens in the target forward, or its shape (rows, tokens per row)


class CostCheck:
    def __init__(self, tolerance: float = 1.5, min_rounds: int = 3, window: int = 9):
        self.tolerance, self.min_rounds, self.window = tolerance, min_rounds, window
        self.corrections = 0  # profiles this check has replaced
        self.reset()

    def reset(self):
        """Forget the rounds seen (a new profile is installed)."""
        self.verify: dict[Point, deque[float]] = {}  # measured seconds by operating point
        self.draft: deque[tuple[float, float]] = deque(maxlen=self.window)  # (measured, predicted)

    def observe(
        self, cost: RoundCostModel, point: Point, verify_s: float, forwards: int, row_forwards: float, draft_s: float
    ) -> CostProfile | None:
        """One measured round; returns a corrected profile when the shape is wrong, else None.
        point: the target forward's tokens, or its (rows, tokens per row) (point_of)."""
        point = tuple(int(x) for x in point) if isinstance(point, tuple) else int(point)
        self.verify.setdefault(point, deque(maxlen=self.window)).append(float(verify_s))
        if forwards > 0:
            self.draft.append((float(draft_s), float(cost.draft_s(forwards, row_forwards))))
        ratios = self._ratios(cost)
        if len(ratios) < 2:
            return None
        values = list(ratios.values())
        if max(values) <= self.tolerance * min(values):
            return None
        self.corrections += 1
        return corrected(cost, self._measured(), ratios.get("draft"))

    def _measured(self) -> dict[Point, float]:
        """Median measured seconds by operating point, where enough rounds were seen."""
        return {n: statistics.median(s) for n, s in self.verify.items() if len(s) >= self.min_rounds}

    def _ratios(self, cost: RoundCostModel) -> dict:
        out = {n: t / max(predicted(cost, n), 1e-12) for n, t in self._measured().items()}
        if len(self.draft) >= self.min_rounds:
            out["draft"] = statistics.median(m / max(p, 1e-12) for m, p in self.draft)
        return out


def point_of(cost: RoundCostModel, drafted: list[int]) -> Point:
    """The operating point of a round whose rows drafted these many: (rows, widest + 1) where the
    model prices the padded shape, else the tokens verified."""
    if cost.batched:
        return len(drafted), max(drafted, default=0) + 1
    return sum(n + 1 for n in drafted)


def predicted(cost: RoundCostModel, point: Point) -> float:
    """The model's seconds of the target forward at an operating point."""
    return cost.verify_width_s(*point) if isinstance(point, tuple) else cost.verify_s(point)


def corrected(cost: RoundCostModel, measured: dict[Point, float], draft_ratio: float | None) -> CostProfile:
    if cost.batched:
        return corrected_table(cost, measured, draft_ratio)
    return corrected_curve(cost, {int(n): s for n, s in measured.items() if not isinstance(n, tuple)}, draft_ratio)


def corrected_table(
    cost: RoundCostModel, measured: dict[tuple[int, int], float], draft_ratio: float | None
) -> CostProfile:
    """A batch table's profile with the measured seconds at the shapes seen that are its cells,
    every other cell scaled by the ratio measured / predicted of the nearest shape seen (in
    log2 rows and tokens per row), the token curve by their mean ratio, and the draft
    coefficients by their measured ratio (without one, by that mean: the machine's speed)."""
    p, table = cost.profile, cost.profile.verify_batch
    seen = np.log2(np.array(list(measured), dtype=float))  # [S, 2]
    ratio = np.array([s / max(predicted(cost, n), 1e-12) for n, s in measured.items()])  # [S]
    seconds = []
    for b in table.rows:
        line = []
        for t in table.tokens_per_row:
            nearest = int(np.argmin(((seen - np.log2([b, t])) ** 2).sum(-1)))
            line.append(measured.get((b, t), cost.verify_width_s(b, t) * ratio[nearest]))
        seconds.append(line)
    mean = float(np.exp(np.log(np.maximum(ratio, 1e-12)).mean()))
    scale = draft_ratio if draft_ratio is not None else mean
    e, c, d = (float(x) * scale for x in cost.draft_coefficients)
    return CostProfile(
        list(p.verify_tokens),
        [float(x) * mean for x in p.verify_seconds],
        e,
        c,
        d,
        cost.overhead_s,
        "corrected from measured rounds",
        {},
        BatchVerify(list(table.rows), list(table.tokens_per_row), seconds),
    )


def corrected_curve(cost: RoundCostModel, measured: dict[int, float], draft_ratio: float | None) -> CostProfile:
    """The profile with the measured verify seconds at the token counts seen, the model's own
    knots outside that range scaled by the ratio at the nearest end, and the draft coefficients
    scaled by their measured ratio (without one, by the target's mean ratio: the machine's speed)."""
    seen = np.array(sorted(measured), dtype=float)  # [S]
    seconds = np.array([measured[int(n)] for n in seen])  # [S]
    ratio = seconds / np.maximum(cost.verify_s(seen), 1e-12)  # [S]
    below = cost.knots[cost.knots < seen[0]]
    above = cost.knots[cost.knots > seen[-1]]
    tokens = np.concatenate([below, seen, above])
    values = np.concatenate([cost.verify_s(below) * ratio[0], seconds, cost.verify_s(above) * ratio[-1]])
    if len(tokens) < 2:  # one operating point and no knot beside it: keep the model's slope there
        tokens = np.array([seen[0], seen[0] + 1.0])
        values = np.array([seconds[0], seconds[0] + (cost.verify_s(seen[0] + 1) - cost.verify_s(seen[0])) * ratio[0]])
    scale = draft_ratio if draft_ratio is not None else float(np.exp(np.log(np.maximum(ratio, 1e-12)).mean()))
    e, c, d = (float(x) * scale for x in cost.draft_coefficients)
    return CostProfile(
        tokens.tolist(),
        np.maximum.accumulate(values).tolist(),
        e,
        c,
        d,
        cost.overhead_s,
        "corrected from measured rounds",
    )


class UnderLoad:
    """`model`: the frozen model with, from the last `window` readings (the module docstring), its
    drafter priced by the slope and fixed price of drafting rounds (by one ratio before `min_pairs`
    pairs read a slope) and, with a batch table, its widths priced by the median beta; refit every
    `every` readings once `min_rounds` rounds or `min_pairs` pairs were seen (None before).
    Predictions are the frozen model's (with beta applied), so corrections never compound."""

    def __init__(self, every: int = 8, window: int = 32, min_rounds: int = 8, min_pairs: int = 6):
        self.every, self.min_rounds, self.min_pairs = every, min_rounds, min_pairs
        self.relative: deque[float] = deque(maxlen=window)  # per round: drafter ratio / target ratio
        self.drafts: deque[tuple[float, float]] = deque(maxlen=window)  # per round: (drafting in profile s, predicted)
        self.betas: deque[float] = deque(maxlen=window)  # per pair of rounds: the price of width
        self.slopes: deque[float] = deque(maxlen=window)  # per pair of rounds: the drafter's price of a forward
        self.reset()

    def reset(self) -> None:
        """Forget the rounds seen and the correction (a new profile is installed)."""
        for window in (self.relative, self.drafts, self.betas, self.slopes):
            window.clear()
        self.model: RoundCostModel | None = None
        self.rounds = 0  # rounds with a drafting call kept since the last reset
        self.pairs = 0  # pairs of consecutive rounds of two widths kept since the last reset
        self.draft_pairs = 0  # pairs of consecutive drafting calls of two lengths since the last reset
        self.refits = 0
        self.applied: float | None = None  # the drafter ratio measured at the last refit
        self.applied_beta: float | None = None  # the price of width `model` was built with
        self.applied_slope: float | None = None  # the drafter's slope `model` was built with
        self.applied_round_s: float | None = None  # the drafting round's fixed price it was built with
        self._unread = 0  # readings since the last refit
        self._last: _Shape | None = None  # the round before, if it can pair with the next

    @property
    def draft_ratio(self) -> float | None:
        """The drafter's cost relative to the target's, measured / profile (None before min_rounds)."""
        return statistics.median(self.relative) if len(self.relative) >= self.min_rounds else None

    @property
    def beta(self) -> float | None:
        """One more token a row in the target's forward, measured / profile (None before min_pairs)."""
        return statistics.median(self.betas) if len(self.betas) >= self.min_pairs else None

    @property
    def draft_slope(self) -> float | None:
        """One more drafter forward, measured / profile (None before min_pairs)."""
        return statistics.median(self.slopes) if len(self.slopes) >= self.min_pairs else None

    def skip(self) -> None:
        """A round this model does not read (a row alone, or one that prefilled a prompt, whose
        forward is no batch-table shape): the next round pairs with none."""
        self._last = None

    def observe(
        self, cost: RoundCostModel, ks: list[int], forwards: int, row_forwards: float, draft_s: float, verify_s: float
    ) -> None:
        """One round of two rows or more (rows drafted ks, the drafter ran `forwards` batched
        forwards holding `row_forwards` rows in all), measured; cost: the frozen model. A round
        without a drafting call tells nothing of the drafter, but may pair for width."""
        draft_pred, verify_pred = float(cost.draft_s(forwards, row_forwards)), self._verify_pred(cost, ks)
        drafted = forwards > 0 and min(draft_s, verify_s, draft_pred, verify_pred) > 0
        now = _Shape(len(ks), max(ks) + 1, 0.0, verify_s, verify_pred, draft_pred if drafted else 0.0, draft_s)
        read = self._observe_pair(cost, now)
        if drafted:
            host = verify_s / verify_pred  # the host's speed now against the profile's
            self.relative.append((draft_s / draft_pred) / host)
            self.drafts.append((draft_s / host, draft_pred))
            self.rounds += 1
            read += 1
        self._unread += read
        if self._unread >= self.every:
            self._unread = 0
            self._refit(cost)

    def _observe_pair(self, cost: RoundCostModel, now: "_Shape") -> int:
        """Pair this round with the one before (same rows, another width): the readings it gave."""
        if not cost.batched or now.seconds <= 0:
            self._last = None
            return 0
        base = _base_s(cost, now.rows)
        now.width_s = float(cost.verify_width_s(now.rows, now.width)) - base
        last, self._last = self._last, now
        if last is None or last.rows != now.rows or last.width == now.width:
            return 0
        narrow, wide = sorted((last, now), key=lambda shape: shape.width)
        read = 0
        beta = width_price(base, narrow.width_s, narrow.seconds, wide.width_s, wide.seconds)
        if beta is not None:
            self.betas.append(beta)
            self.pairs += 1
            read += 1
        slope = draft_slope(narrow, wide)
        if slope is not None:
            self.slopes.append(slope)
            self.draft_pairs += 1
            read += 1
        return read

    def _verify_pred(self, cost: RoundCostModel, ks: list[int]) -> float:
        """The frozen model's verification of ks, its width at the price applied."""
        pred = float(cost.verify_round_s(ks))
        if self.applied_beta is None or not cost.batched:
            return pred
        base = _base_s(cost, len(ks))
        return base + self.applied_beta * (pred - base)

    def _refit(self, cost: RoundCostModel) -> None:
        ratio, beta, slope = self.draft_ratio, self.beta, self.draft_slope
        if ratio is None and beta is None:
            return
        p, b = cost.profile, beta or 1.0
        scale, round_s = ratio or 1.0, p.draft_per_round * (ratio or 1.0)
        if slope is not None and self.drafts:
            # the fixed price: what the drafting rounds cost beyond the slope's forwards
            scale = slope
            extra = statistics.median(seconds - slope * pred for seconds, pred in self.drafts)
            round_s = max(p.draft_per_round * slope + extra, 0.0)
        table = p.verify_batch
        if table is not None and beta is not None:
            table = replace(table, seconds=[[line[0] + b * (x - line[0]) for x in line] for line in table.seconds])
        self.model = RoundCostModel(
            replace(
                p,
                draft_per_round=round_s,
                draft_per_forward=p.draft_per_forward * scale,
                draft_per_row_forward=p.draft_per_row_forward * scale,
                verify_batch=table,
                source=f"{p.source}, drafter x {scale:.3g} + {round_s:.3g} s a round, width x {b:.3g} under load",
            )
        )
        self.refits, self.applied, self.applied_beta = self.refits + 1, ratio, beta
        self.applied_slope, self.applied_round_s = (slope, round_s) if slope is not None else (None, None)


@dataclass
class _Shape:
    """A measured round as the pairs read it."""

    rows: int
    width: int  # tokens a row in the target's forward (max k + 1)
    width_s: float  # the frozen model's seconds for it beyond the base (the narrowest width)
    seconds: float  # the target call as measured
    verify_pred: float  # the target call as the model predicts it
    draft_pred: float  # the drafting call as the frozen model predicts it (0: none, or not read)
    draft_s: float  # the drafting call as measured


def draft_slope(narrow: _Shape, wide: _Shape, lo: float = 0.25, hi: float = 4.0) -> float | None:
    """The drafter's price of a forward, measured / profile, from two consecutive drafting calls:
    the difference of their seconds over the difference predicted, over the pair's host speed
    (its verifications measured / predicted). Clipped to [lo, hi]; None where either round did
    not draft or the profile prices both calls alike."""
    if min(narrow.draft_pred, wide.draft_pred) <= 0 or wide.draft_pred == narrow.draft_pred:
        return None
    host = (narrow.seconds + wide.seconds) / (narrow.verify_pred + wide.verify_pred)
    slope = (wide.draft_s - narrow.draft_s) / (wide.draft_pred - narrow.draft_pred) / host
    return min(max(slope, lo), hi)


def _base_s(cost: RoundCostModel, rows: int) -> float:
    """The frozen model's forward of `rows` rows at the batch table's narrowest width."""
    return float(cost.verify_width_s(rows, cost.profile.verify_batch.tokens_per_row[0]))


def width_price(
    base: float, narrow_s: float, narrow_meas: float, wide_s: float, wide_meas: float, lo: float = 0.25, hi: float = 4.0
) -> float | None:
    """beta of a pair of rounds of the same rows: wide_meas / narrow_meas = (base + beta x wide_s)
    / (base + beta x narrow_s), *_s the frozen model's width parts (beyond base) of each round,
    *_meas the measured seconds. Clipped to [lo, hi]; None where the model prices both alike."""
    if wide_s <= narrow_s or narrow_meas <= 0:
        return None
    r = wide_meas / narrow_meas
    den = wide_s - r * narrow_s
    if den <= 0:  # the measured step is steeper than any beta can make it
        return hi
    return min(max(base * (r - 1.0) / den, lo), hi)
