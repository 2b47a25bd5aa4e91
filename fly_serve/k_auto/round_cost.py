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

Verify-time model. The target verifies the round's rows in one forward of [B, W] tokens, W =
max_b (k_b + 1): rows are right-padded to the longest (runner.py), and B one-token rows, each
attending its own context, cost otherwise than one row of B tokens. A measured profile therefore
carries a table of seconds by (rows, tokens per row), BatchVerify, timed at those shapes, and a
round costs its padded shape read off it: a row below the widest drafts for free in the target,
raising the widest costs the step of all B rows. A profile without the table (written by hand,
an older tune-k, the default shape, a corrected one) prices the forward by its real tokens
sum_b (k_b + 1) on the one-row curve.
"""

import math
from dataclasses import dataclass, field, replace

import numpy as np

# How a row drafts: drafter forwards, a model-free source (prompt lookup, the suffix index over
# earlier requests, Token Recycling), not at all. The model-free kinds share one cost: their
# drafting is free (microseconds, no forward), so a draft costs only its share of the target forward.
MODEL, PLD, SUFFIX, RECYCLE, NONE = "model", "pld", "suffix", "recycle", "none"
FREE_KINDS = (PLD, SUFFIX, RECYCLE)
KINDS = (MODEL, *FREE_KINDS, NONE)


@dataclass
class BatchVerify:
    """The target forward's seconds by its shape: seconds[i][j] for rows[i] rows of
    tokens_per_row[j] tokens each (the last token and k = tokens_per_row - 1 drafts)."""

    rows: list[int]
    tokens_per_row: list[int]
    seconds: list[list[float]]  # [R, T]

    def __post_init__(self):
        shape = (len(self.rows), len(self.tokens_per_row))
        if np.asarray(self.seconds, dtype=float).shape != shape:
            raise ValueError(f"profile verify batch: seconds must be rows x tokens_per_row, {shape}")
        if min(shape) < 1 or len(set(self.rows)) != shape[0] or len(set(self.tokens_per_row)) != shape[1]:
            raise ValueError("profile verify batch: needs distinct rows and tokens_per_row")

    def to_dict(self) -> dict:
        return {
            "rows": [int(b) for b in self.rows],
            "tokens_per_row": [int(t) for t in self.tokens_per_row],
            "seconds": [[_sig(x) for x in line] for line in self.seconds],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BatchVerify":
        return cls(
            [int(b) for b in d["rows"]],
            [int(t) for t in d["tokens_per_row"]],
            [[float(x) for x in line] for line in d["seconds"]],
        )


@dataclass
class CostProfile:
    """A round's costs as measured on one machine (seconds). verify_tokens / verify_seconds: the
    target forward by tokens in it (all rows together); draft_*: e, c, d of the module docstring
    (of the engine's default drafter); overhead_s: the rest of a round (decide, commit); source:
    where it was measured (free text); verify_batch: the forward by batch shape (BatchVerify),
    which prices rounds where present; drafters: the other model drafters' own e, c, d by their
    names ({"per_round", "per_forward", "per_row_forward"}), for an engine with several."""

    verify_tokens: list[float]
    verify_seconds: list[float]
    draft_per_round: float = 0.0
    draft_per_forward: float = 0.0
    draft_per_row_forward: float = 0.0
    overhead_s: float = 0.0
    source: str = ""
    extra: dict = field(default_factory=dict)  # what the measurement saw (points, key), kept verbatim
    verify_batch: BatchVerify | None = None
    drafters: dict = field(default_factory=dict)

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
                **({"batch": self.verify_batch.to_dict()} if self.verify_batch is not None else {}),
            },
            "draft": {
                "per_round": _sig(self.draft_per_round),
                "per_forward": _sig(self.draft_per_forward),
                "per_row_forward": _sig(self.draft_per_row_forward),
            },
            "overhead_s": _sig(self.overhead_s),
        }
        if self.drafters:
            out["drafters"] = {
                name: {k: _sig(v) for k, v in sorted(coef.items())} for name, coef in sorted(self.drafters.items())
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
            BatchVerify.from_dict(v["batch"]) if "batch" in v else None,
            {name: {k: float(x) for k, x in coef.items()} for name, coef in d.get("drafters", {}).items()},
        )

    def for_drafter(self, name: str | None) -> "CostProfile":
        """This profile with the named drafter's draft costs (its own, where measured)."""
        coef = self.drafters.get(name) if name is not None else None
        if coef is None:
            return self
        return replace(
            self,
            draft_per_round=float(coef.get("per_round", 0.0)),
            draft_per_forward=float(coef.get("per_forward", 0.0)),
            draft_per_row_forward=float(coef.get("per_row_forward", 0.0)),
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
    """Predicted seconds of a round = overhead + verify + draft(F, sum f) (module docstring).

    verify(n), n = sum_b (k_b + 1) the tokens in the target forward: piecewise linear over the
    profile's measured token counts (a GPU forward is flat until compute-bound, then linear),
    extended linearly past them, non-negative and non-decreasing (more tokens never verify faster).
    With the profile's batch table, a round's verify is its padded shape instead (verify_round_s).
    """

    def __init__(self, profile: CostProfile | dict | None = None):
        self.profile = CostProfile.coerce(profile)
        p = self.profile
        order = np.argsort(np.asarray(p.verify_tokens, dtype=float))
        self.knots = np.asarray(p.verify_tokens, dtype=float)[order]  # [N]
        v = np.maximum.accumulate(np.maximum(np.asarray(p.verify_seconds, dtype=float)[order], 0.0))  # [N]
        self._interp = _extended(self.knots, v)
        # (e per drafting round, c per forward, d per row per forward), non-negative.
        self.draft_coefficients = np.maximum([p.draft_per_round, p.draft_per_forward, p.draft_per_row_forward], 0.0)
        self.overhead_s = max(float(p.overhead_s), 0.0)
        self._batch = _batch_table(p.verify_batch) if p.verify_batch is not None else None
        self._by_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # B -> the curve over tokens per row
        step = self.verify_s(1)  # a one-row drafter forward against a one-token target forward (catch_up_s)
        self._drafter_share = float(self.draft_s(1, 1)) / step if step > 0 else 0.0

    @property
    def batched(self) -> bool:
        """True: rounds are priced by their padded shape (the profile has a batch table)."""
        return self._batch is not None

    def verify_s(self, tokens):
        """Seconds of a target forward over `tokens` tokens (all rows together); arrays too."""
        out = np.maximum(np.interp(tokens, *self._interp), 0.0)
        return out if out.ndim else float(out)

    def verify_width_s(self, rows: int, tokens_per_row):
        """Seconds of a forward of `rows` rows of `tokens_per_row` tokens each (arrays too): the
        batch table, linear between its shapes and past them, non-decreasing both ways. Without a
        table: the one-row curve at rows * tokens_per_row."""
        if self._batch is None:
            return self.verify_s(rows * np.asarray(tokens_per_row, dtype=float))
        curve = self._by_rows.get(rows)
        if curve is None:
            table_rows, widths, seconds = self._batch
            at_rows = [float(np.interp(rows, *_extended(table_rows, seconds[:, j]))) for j in range(len(widths))]
            curve = self._by_rows[rows] = _extended(widths, np.maximum.accumulate(np.maximum(at_rows, 0.0)))
        out = np.maximum(np.interp(tokens_per_row, *curve), 0.0)
        return out if out.ndim else float(out)

    def verify_round_s(self, ks):
        """Seconds of the target forward of a round in which row b drafts ks[b] (ks [..., B]):
        [B, max k + 1] padded with the batch table, else sum (k + 1) tokens on the one-row curve."""
        ks = np.asarray(ks)
        if self._batch is None:
            return self.verify_s((ks + 1).sum(-1))
        return self.verify_width_s(ks.shape[-1], ks.max(-1) + 1)

    def draft_s(self, forwards, row_forwards):
        """Seconds of a drafting call of `forwards` batched forwards holding `row_forwards` rows in all."""
        e, c, d = self.draft_coefficients
        forwards = np.asarray(forwards, dtype=float)
        out = np.where(forwards > 0, e + c * forwards + d * np.asarray(row_forwards, dtype=float), 0.0)
        return out if out.ndim else float(out)

    def catch_up_s(self, tokens: int) -> float:
        """Seconds for the drafter to prefill `tokens` it has not seen (a row that decoded plainly
        since it last drafted, or a prompt it never drafted for): the target's forward over as many
        tokens, scaled by what a one-row drafter forward costs against a one-token target forward
        (the same kernels on fewer weights). The profile times no drafter prefill of its own."""
        return self.verify_s(tokens) * self._drafter_share if tokens > 0 else 0.0

    def round_s(self, ks, rows, overlap: bool = False) -> float:
        """Predicted seconds of a round in which row b drafts ks[b] (rows: allocator.RowInfo);
        overlap: with draft-ahead (the module docstring; a row's acceptance gives its bet's chance)."""
        ks = np.asarray(ks, dtype=float)  # [B]
        model = np.array([r.source == MODEL for r in rows], dtype=bool)  # [B]
        tpf = np.array([tokens_per_forward(r) for r in rows])  # [B]
        f = np.where(model, ks / tpf, 0.0)  # [B] drafter forwards each row is in
        forwards = math.ceil(float(f.max()) - 1e-9) if len(rows) else 0
        verify = self.verify_round_s(ks) if len(rows) else 0.0
        if not overlap:
            return float(self.overhead_s + verify + self.draft_s(forwards, f.sum()))
        e, c, d = self.draft_coefficients
        shared = (e + c * forwards) if forwards > 0 else 0.0
        hit = hit_chance(ks, [r.acceptance or 0.0 for r in rows], model)
        peek = (c + d * int((model & (ks > 0)).sum())) if forwards > 0 else 0.0
        return float(self.overhead_s + overlapped_s(verify, shared, d * f, hit, peek))


def _extended(knots, values) -> tuple[np.ndarray, np.ndarray]:
    """np.interp's (x, y) for a piecewise-linear curve through (knots, values) that goes on
    linearly past either end: one far point past each end, so one np.interp call extrapolates the
    end segments. A single knot: flat."""
    k, v = np.asarray(knots, dtype=float), np.asarray(values, dtype=float)
    if len(k) < 2:
        return np.array([k[0] - 1.0, k[0] + 1.0]), np.array([v[0], v[0]])
    far = 1e7 * max(k[-1] - k[0], 1.0)
    lo = v[0] - (v[1] - v[0]) / (k[1] - k[0]) * far
    hi = v[-1] + (v[-1] - v[-2]) / (k[-1] - k[-2]) * far
    return np.concatenate([[k[0] - far], k, [k[-1] + far]]), np.concatenate([[lo], v, [hi]])


def _batch_table(batch: BatchVerify) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows [R], tokens per row [T], seconds [R, T]) sorted, seconds non-negative and
    non-decreasing in both (more rows or more tokens never verify faster)."""
    rows, widths = np.asarray(batch.rows, dtype=float), np.asarray(batch.tokens_per_row, dtype=float)
    r, t = np.argsort(rows), np.argsort(widths)
    seconds = np.maximum(np.asarray(batch.seconds, dtype=float)[r][:, t], 0.0)
    return rows[r], widths[t], np.maximum.accumulate(np.maximum.accumulate(seconds, 0), 1)


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
