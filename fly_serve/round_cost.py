"""Predicted seconds of a round (k "auto"), from a measured cost profile.

  CostProfile     the measurement: the target's forward seconds by tokens in it, the drafter's
                  seconds per forward and per row in a forward, the rest of a round. Written by
                  cost_calibration.py (at start, cached) and `fly-serve tune-k`; read back from
                  YAML / JSON with from_dict.
  RoundCostModel  predictions from one profile. Frozen: it never learns from round times, so
                  the same request gets the same plan whatever the clock said (a new profile
                  comes only from a recalibration: SpeculationPolicy.set_profile).

Draft-time model. The drafter runs one batched forward per drafted position, holding the rows
that still draft. A row drafting k tokens at t tokens per forward (t = 1 without MLA; with MLA a
forward may also confirm a lookup proposal, so t >= 1 is measured per row) is in f = k / t of the
forwards, and the round runs F = ceil(max_b f_b) forwards. So

    draft seconds = e * [F > 0] + c * F + d * sum_b f_b

c is paid once per forward, whatever the number of rows in it; d once per row in a forward; e
once per round that drafts (the catch-up of lagging rows, Python). Raising the longest row's k
adds a forward (c + d); raising a row below it adds only that row's share (d).

Draft-ahead (draft_ahead.py). The drafter drafts round r+1 while the target verifies round r, so
a round costs the longer of the two sides, plus what does not overlap: the drafting of the rows
whose bet was lost (they draft again before the next verify). A row's bet wins when all k of its
drafts and the guessed bonus are kept, a**(k+1) at per-token acceptance a, so

    round seconds = overhead + max(verify, draft + peek) + redraft
    redraft       = (e + c * F) * (1 - prod_b hit_b) + d * sum_b f_b * (1 - hit_b)

peek being the drafter's one forward for its own next token. More drafts stay free until
drafting meets verification; past that each costs its whole time, and every draft lowers the
chance the bet wins.
"""

import math
from dataclasses import dataclass, field

import numpy as np

# How a row drafts: drafter forwards, a model-free source (prompt lookup, the suffix index over
# earlier requests, Token Recycling), not at all. The model-free kinds share one cost: their
# drafting is free (microseconds, no forward), so a draft costs only its share of the target forward.
MODEL, PLD, SUFFIX, RECYCLE, NONE = "model", "pld", "suffix", "recycle", "none"
FREE_KINDS = (PLD, SUFFIX, RECYCLE)
KINDS = (MODEL, *FREE_KINDS, NONE)


@dataclass
class CostProfile:
    """A round's costs as measured on one machine (seconds). verify_tokens / verify_seconds: the
    target forward by tokens in it (all rows together); draft_*: e, c, d of the module docstring;
    overhead_s: the rest of a round (decide, commit); source: where it was measured (free text)."""

    verify_tokens: list[float]
    verify_seconds: list[float]
    draft_per_round: float = 0.0
    draft_per_forward: float = 0.0
    draft_per_row_forward: float = 0.0
    overhead_s: float = 0.0
    source: str = ""
    extra: dict = field(default_factory=dict)  # what the measurement saw (points, key), kept verbatim

    def __post_init__(self):
        if len(self.verify_tokens) != len(self.verify_seconds):
            raise ValueError("profile verify: tokens and seconds differ in length")
        if len(self.verify_tokens) < 2 or len(set(self.verify_tokens)) != len(self.verify_tokens):
            raise ValueError("profile verify: needs two or more distinct token counts")

    def to_dict(self) -> dict:
        """Plain floats and lists, YAML / JSON-ready; from_dict of it is equal."""
        out = {
            "verify": {
                "tokens": [_num(x) for x in self.verify_tokens],
                "seconds": [_sig(x) for x in self.verify_seconds],
            },
            "draft": {
                "per_round": _sig(self.draft_per_round),
                "per_forward": _sig(self.draft_per_forward),
                "per_row_forward": _sig(self.draft_per_row_forward),
            },
            "overhead_s": _sig(self.overhead_s),
        }
        if self.source:
            out["source"] = self.source
        if self.extra:
            out["extra"] = self.extra
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        """A profile as to_dict writes it; the draft entry may also be measured seconds per forward
        by rows in it ({"rows": [...], "seconds": [...], "per_round": e}), fitted as c + d * rows."""
        v, draft = d["verify"], d.get("draft", {})
        if "rows" in draft:
            c, slope = fit_per_forward(draft["rows"], draft["seconds"])
        else:
            c, slope = float(draft.get("per_forward", 0.0)), float(draft.get("per_row_forward", 0.0))
        return cls(
            [float(x) for x in v["tokens"]],
            [float(x) for x in v["seconds"]],
            float(draft.get("per_round", 0.0)),
            c,
            slope,
            float(d.get("overhead_s", 0.0)),
            str(d.get("source", "")),
            dict(d.get("extra", {})),
        )

    @classmethod
    def coerce(cls, profile: "CostProfile | dict | None") -> "CostProfile":
        """A profile from what callers pass: a CostProfile, its dict, or None (DEFAULT_PROFILE)."""
        if profile is None:
            return DEFAULT_PROFILE
        return profile if isinstance(profile, CostProfile) else cls.from_dict(profile)


def fit_per_forward(rows, seconds) -> tuple[float, float]:
    """(c, d) of seconds per drafter forward = c + d * rows, least squares, both >= 0."""
    rows, seconds = np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float)
    if len(np.unique(rows)) < 2:
        return max(float(seconds.mean()), 0.0), 0.0
    c, d = np.linalg.lstsq(np.column_stack([np.ones_like(rows), rows]), seconds, rcond=None)[0]
    return max(float(c), 0.0), max(float(d), 0.0)


def _sig(x: float) -> float:
    return float(f"{float(x):.6g}")


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


# Without a measurement: a shape only, in units of one single-token target forward. Uncalibrated
# engines run on it; SpeculationPolicy's check replaces it once real rounds contradict its shape.
DEFAULT_PROFILE = CostProfile([1, 64, 1024], [1.0, 2.0, 17.0], 0.0, 0.1, 0.01, 0.0, "default shape")


class RoundCostModel:
    """Predicted seconds of a round = overhead + verify(n) + draft(F, sum f) (module docstring).

    verify(n), n = sum_b (k_b + 1) the tokens in the target forward: piecewise linear over the
    profile's measured token counts (a GPU forward is flat until compute-bound, then linear),
    extended linearly past them, non-negative and non-decreasing (more tokens never verify faster).
    """

    def __init__(self, profile: CostProfile | dict | None = None):
        self.profile = CostProfile.coerce(profile)
        p = self.profile
        order = np.argsort(np.asarray(p.verify_tokens, dtype=float))
        self.knots = np.asarray(p.verify_tokens, dtype=float)[order]  # [N]
        v = np.maximum.accumulate(np.maximum(np.asarray(p.verify_seconds, dtype=float)[order], 0.0))  # [N]
        # One far point past each end, so one np.interp call extrapolates the end segments.
        k, far = self.knots, 1e7 * max(self.knots[-1] - self.knots[0], 1.0)
        lo = v[0] - (v[1] - v[0]) / (k[1] - k[0]) * far
        hi = v[-1] + (v[-1] - v[-2]) / (k[-1] - k[-2]) * far
        self._interp = (np.concatenate([[k[0] - far], k, [k[-1] + far]]), np.concatenate([[lo], v, [hi]]))
        # (e per drafting round, c per forward, d per row per forward), non-negative.
        self.draft_coefficients = np.maximum([p.draft_per_round, p.draft_per_forward, p.draft_per_row_forward], 0.0)
        self.overhead_s = max(float(p.overhead_s), 0.0)

    def verify_s(self, tokens):
        """Seconds of a target forward over `tokens` tokens (all rows together); arrays too."""
        out = np.maximum(np.interp(tokens, *self._interp), 0.0)
        return out if out.ndim else float(out)

    def draft_s(self, forwards, row_forwards):
        """Seconds of a drafting call of `forwards` batched forwards holding `row_forwards` rows in all."""
        e, c, d = self.draft_coefficients
        forwards = np.asarray(forwards, dtype=float)
        out = np.where(forwards > 0, e + c * forwards + d * np.asarray(row_forwards, dtype=float), 0.0)
        return out if out.ndim else float(out)

    def round_s(self, ks, rows, overlap: bool = False) -> float:
        """Predicted seconds of a round in which row b drafts ks[b] (rows: allocator.RowInfo);
        overlap: with draft-ahead (the module docstring; a row's acceptance gives its bet's chance)."""
        ks = np.asarray(ks, dtype=float)  # [B]
        model = np.array([r.drafter == MODEL for r in rows], dtype=bool)  # [B]
        tpf = np.array([tokens_per_forward(r) for r in rows])  # [B]
        f = np.where(model, ks / tpf, 0.0)  # [B] drafter forwards each row is in
        forwards = math.ceil(float(f.max()) - 1e-9) if len(rows) else 0
        verify = self.verify_s(float((ks + 1).sum()))
        if not overlap:
            return float(self.overhead_s + verify + self.draft_s(forwards, f.sum()))
        e, c, d = self.draft_coefficients
        shared = (e + c * forwards) if forwards > 0 else 0.0
        hit = hit_chance(ks, [r.acceptance or 0.0 for r in rows], model)
        peek = (c + d * int((model & (ks > 0)).sum())) if forwards > 0 else 0.0
        return float(self.overhead_s + overlapped_s(verify, shared, d * f, hit, peek))


def hit_chance(k, a, model):
    """The chance a row's draft-ahead bet wins, a**(k+1); 1 for a row that does not draft with the
    model (it has no drafting to redo). k, a, model broadcast ([..., B])."""
    k, a = np.asarray(k, dtype=float), np.asarray(a, dtype=float)
    return np.where(np.asarray(model) & (k > 0), a ** (k + 1.0), 1.0)


def overlapped_s(verify, shared, per_row, hit, peek):
    """Seconds of a draft-ahead round's work (the module docstring's formula, without overhead).
    verify, shared (e + c * F, the per-round and per-forward part of drafting), peek [...];
    per_row (d * f_b), hit [..., B]."""
    per_row, hit = np.asarray(per_row, dtype=float), np.asarray(hit, dtype=float)
    draft = shared + per_row.sum(-1)
    redraft = shared * (1.0 - hit.prod(-1)) + (per_row * (1.0 - hit)).sum(-1)
    return np.maximum(verify, draft + peek) + redraft


def tokens_per_forward(row) -> float:
    """A row's drafts per drafter forward (1 when unknown), kept away from 0."""
    return max(row.tokens_per_forward or 1.0, 1e-3)
