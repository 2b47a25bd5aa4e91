"""k "auto"'s cost model for rounds of two rows or more: the frozen profile with the drafter
priced against the target, and the target's width against its base, as the rounds under load
measure them.

The profile is timed at start on an idle host, each part alone (cost_calibration.py). Under load
the drafter is not what it timed: a served ingress streams every row's text to its client while
the drafter runs (the first phase of the next round), and a drafter call catches up the tokens the
round before accepted. On the 2-core CPU a drafting call cost 1.3-1.6x its prediction relative to
the verification of the same round, over hundreds of rounds at 8 users (docs/journal.md), and
between k 1 and k 3 at 6-8 rows that error decides the plan.

What is corrected is the ratio of the two parts, measured within each round: (drafting seconds /
predicted) / (verification seconds / predicted). A drift of the host's speed over minutes (20-30%
on the VM) slows both halves of a round alike and cancels; the median over a window of rounds
keeps one slow call from moving it. The verification's table is not corrected cell by cell:
per-shape corrections from live rounds compare shapes seen minutes apart, which that drift
confounds; only its width as a whole, from rounds seconds apart (below).

The price of width. Whether 8 rows draft 1 or 2 a round turns on what one more token a row adds
to the target's forward, and that price moves with the host: the forward of a few tokens a row
is bound by memory bandwidth, its width by arithmetic, and a busy neighbour on the VM slows the
first more than the second. On the 2-core CPU two calibrations a few hours apart priced
[8, 4] / [8, 2] at 1.70 and 1.40; k auto planned k 1 from one and 2-3 drafts from the other, and
k 2 beat both by 7-16% (docs/journal.md). So with a batch table the target is modelled as
base(B) + beta x (table(B, T) - base(B)), base(B) the one-token forward of B rows: beta scales the
width against the base, and the base's drift cancels. beta comes from pairs of consecutive rounds
of the same rows count and different widths (seconds apart, the host's speed is the same): their
ratio of measured seconds solves for it; the median of the last `window` pairs, clipped to
[1/4, 4]. The plan keeps one width in steady state, so the policy steps it now and then
(SpeculationPolicy: every width_every-th round of two rows or more, the widest rows one draft up
or down in turn).

A drafting round's fixed price. A served round's drafter call is not the profile's forwards
times a ratio: the first forward after a round shares the cores with that round's streaming (the
ingress serializes every row's chunk, the proxy relays it) and carries the catch-up of the tokens
kept. Through Serve at 8 streamed users on the 2-core CPU a drafting call of 1, 2 and 4 forwards
took 54, 80 and 127 ms: 25 ms a forward, as profiled, plus ~30 ms a round, where one process
paid none. One ratio for all of it overcharges long drafts and undercharges short ones. So the
same pairs of rounds, where their drafting calls ran different numbers of forwards, read the
drafter's slope: the difference of the two calls over the difference the profile predicts (over
the pair's host speed, its verifications measured / predicted); the median of the last `window`
pairs, clipped to [1/4, 4]. The rest of each drafting round (in the profile's seconds, as the
ratio reads them) is the round's fixed price, the median over the window. Until pairs come (no
batch table, no steps) the one ratio prices the drafter.

A row alone keeps the frozen profile (SpeculationPolicy.cost_for), so a greedy request sent alone
gets the same plan every time; under load a batch's text already depends on its other rows.
"""

import statistics
from collections import deque
from dataclasses import dataclass, replace

from .round_cost import RoundCostModel


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
