"""k "auto"'s cost model for rounds of two rows or more: the frozen profile with the drafter
priced against the target as the rounds under load measure them.

The profile is timed at start on an idle host, each part alone (cost_calibration.py). Under load
the drafter is not what it timed: a served ingress streams every row's text to its client while
the drafter runs (the first phase of the next round), and a drafter call catches up the tokens the
round before accepted. On the 2-core CPU a drafting call cost 1.3-1.6x its prediction relative to
the verification of the same round, over hundreds of rounds at 8 users (docs/BENCHMARKS.md), and
between k 1 and k 3 at 6-8 rows that error decides the plan.

What is corrected is the ratio of the two parts, measured within each round: (drafting seconds /
predicted) / (verification seconds / predicted). A drift of the host's speed over minutes (20-30%
on the VM) slows both halves of a round alike and cancels; the median over a window of rounds
keeps one slow call from moving it. The verification's shape stays the profile's: per-shape
corrections from live rounds compare shapes seen minutes apart, which that drift confounds.

A row alone keeps the frozen profile (SpeculationPolicy.cost_for), so a greedy request sent alone
gets the same plan every time; under load a batch's text already depends on its other rows.
"""

import statistics
from collections import deque
from dataclasses import replace

from .round_cost import RoundCostModel


class UnderLoad:
    """`model`: the frozen model with its drafter coefficients scaled by the median of the last
    `window` rounds' relative drafter cost (the module docstring), refit every `every` such
    rounds once `min_rounds` were seen (None before). Predictions are always the frozen model's,
    so corrections never compound."""

    def __init__(self, every: int = 8, window: int = 32, min_rounds: int = 8):
        self.every, self.min_rounds = every, min_rounds
        self.relative: deque[float] = deque(maxlen=window)  # per round: drafter ratio / target ratio
        self.reset()

    def reset(self) -> None:
        """Forget the rounds seen and the correction (a new profile is installed)."""
        self.relative.clear()
        self.model: RoundCostModel | None = None
        self.rounds = 0  # rounds kept since the last reset
        self.refits = 0
        self.applied: float | None = None  # the drafter ratio `model` was built with

    @property
    def draft_ratio(self) -> float | None:
        """The drafter's cost relative to the target's, measured / profile (None before min_rounds)."""
        return statistics.median(self.relative) if len(self.relative) >= self.min_rounds else None

    def observe(
        self, cost: RoundCostModel, ks: list[int], forwards: int, row_forwards: float, draft_s: float, verify_s: float
    ) -> None:
        """One round of two rows or more (rows drafted ks, the drafter ran `forwards` batched
        forwards holding `row_forwards` rows in all), measured; cost: the frozen model. A round
        without a drafting call tells nothing of the ratio."""
        draft_pred, verify_pred = float(cost.draft_s(forwards, row_forwards)), float(cost.verify_round_s(ks))
        if forwards <= 0 or min(draft_s, verify_s, draft_pred, verify_pred) <= 0:
            return
        self.relative.append((draft_s / draft_pred) / (verify_s / verify_pred))
        self.rounds += 1
        ratio = self.draft_ratio if self.rounds % self.every == 0 else None  # the median only when refitting
        if ratio is not None:
            p = cost.profile
            self.model = RoundCostModel(
                replace(
                    p,
                    draft_per_round=p.draft_per_round * ratio,
                    draft_per_forward=p.draft_per_forward * ratio,
                    draft_per_row_forward=p.draft_per_row_forward * ratio,
                    source=f"{p.source}, drafter x {ratio:.3g} under load",
                )
            )
            self.refits, self.applied = self.refits + 1, ratio
