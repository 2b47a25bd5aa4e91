"""How many tokens a row emits, and how often its drafts are kept (k "auto", speculation_policy.py).

  expected_emitted   tokens a row emits with k drafts at per-token acceptance a (geometric model)
  AcceptanceTracker  per row, the chance a draft is kept (FLy's loose acceptances count as kept)
                     and the drafts per drafter forward (MLA)

A row's estimate reads only that row's own rounds and a prior (the tracker's constant, or one
read off the row's own text: a lookup's match length, lookup_match.py), never other requests'
rounds: a greedy request sent alone twice sees the same estimates round by round, so k "auto"
plans it the same way (docs/tuning.md, "How k auto plans").
"""

from dataclasses import dataclass

import numpy as np


def expected_emitted(k, a):
    """Expected tokens emitted by a row with k drafts when each draft is kept with probability a,
    independently, until the first rejection: the kept drafts plus the target's own token,
    sum_{i=0..k} a**i = (1 - a**(k+1)) / (1 - a), and k + 1 at a = 1. Works on arrays."""
    k, a = np.asarray(k, dtype=float), np.asarray(a, dtype=float)
    near_one = np.abs(1.0 - a) < 1e-9
    safe = np.where(near_one, 0.5, a)  # keeps the unused branch finite
    out = np.where(near_one, k + 1.0, (1.0 - safe ** (k + 1.0)) / (1.0 - safe))
    return out if out.ndim else float(out)


@dataclass
class _Evidence:
    kept: float = 0.0  # drafts kept (successes), discounted by age
    rejected: float = 0.0  # rounds that ended in a rejection (failures), discounted by age
    drafted: float = 0.0  # drafts and drafter forwards of model-drafted rounds, for tokens_per_forward
    forwards: float = 0.0


class AcceptanceTracker:
    """Per-token acceptance of each row: a Beta posterior mean over its recent rounds.

    A round's kept count stops at the first rejection, so under the geometric model a round that
    drafted n and kept m holds m successes and one failure if m < n, none if m == n (the row ran
    out of drafts, not of luck): the estimate is kept / (kept + rejections), never kept / drafted.
    Evidence decays by `decay` per round so the estimate follows the text (code, then prose);
    rounds without drafts decay it too, so a row the allocator left at k = 0 drifts back to the
    prior and is tried again instead of staying written off. The prior is a constant with
    `prior_weight` drafts of evidence (not the other rows' mean: see the module docstring).
    """

    def __init__(self, prior: float = 0.7, prior_weight: float = 2.0, decay: float = 0.9):
        if not 0 <= prior < 1:
            raise ValueError("prior must be in [0, 1)")
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.rows: dict[str, _Evidence] = {}

    def observe(self, key: str, drafted: int, kept: int, forwards: int | None = None):
        """One round of one row: drafted tokens, kept ones (accepted + loosely accepted), and the
        drafter forwards the row was in (None: not reported, or not a model-drafted row)."""
        ev = self.rows.setdefault(key, _Evidence())
        _age(ev, self.decay)
        ev.kept += kept
        ev.rejected += kept < drafted
        if forwards:
            ev.drafted += drafted
            ev.forwards += forwards

    def observe_round(self, keys, drafted, kept, forwards=None):
        """Every row of a round at once; forwards: per row, or None."""
        forwards = forwards if forwards is not None else [None] * len(keys)
        for key, n, m, f in zip(keys, drafted, kept, forwards):
            self.observe(key, n, m, f)

    def observe_guess(self, key: str, hit: bool):
        """Draft-ahead: a round kept all its drafts, and the bonus was (hit) or was not the drafter's
        own next token, the guess the ahead drafts were made on. It is one more draft of the round,
        kept or rejected, so it counts as one (no ageing: it belongs to the round just observed)."""
        ev = self.rows.setdefault(key, _Evidence())
        ev.kept += hit
        ev.rejected += not hit

    def estimate(self, key: str, prior: float | None = None) -> float:
        """Per-token acceptance in [0, 1); a row never seen gets the prior (the tracker's, or this
        call's: what the row's offer is known by, lookup_match.py)."""
        prior = self.prior if prior is None else prior
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

    def age(self, key: str):
        """Age a known key's evidence by one round without observing it (its row drafted from
        another source this round); an unknown key stays unknown."""
        ev = self.rows.get(key)
        if ev is not None:
            _age(ev, self.decay)

    def forget(self, key: str):
        self.rows.pop(key, None)


def _age(ev: _Evidence, factor: float):
    ev.kept, ev.rejected = ev.kept * factor, ev.rejected * factor
    ev.drafted, ev.forwards = ev.drafted * factor, ev.forwards * factor
