"""Whether measured rounds contradict the cost model's shape, and the profile that fixes it.

The round cost model is frozen (round_cost.py), so a profile measured on another machine, or the
default shape of an uncalibrated engine, would stay wrong for the engine's life: a model that
overprices drafts plans k = 0 and never sees a round that would show otherwise. The policy's
probes (speculation_policy.py) run drafting rounds now and then; this check compares every
round's measured seconds with the model's prediction at that operating point.

Only the shape counts: a machine uniformly slower or faster than the profile (a longer context, a
busier host) scales every prediction alike and leaves the plan unchanged, so the check ignores it.
It recalibrates when the ratio measured / predicted differs between operating points (target
forwards of different token counts, drafter calls) by more than `tolerance`, each point the
median of its last `window` rounds and at least `min_rounds` of them. Wall-clock noise well below
the tolerance therefore never changes a plan; a wrong seed does, once, within a few probes.

An operating point is the target forward as the model prices it: its tokens (a profile without a
batch table), or its shape (rows, tokens per row) with one, so that a batch table is compared
with what it predicts and corrected as a table.
"""

import statistics
from collections import deque

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
