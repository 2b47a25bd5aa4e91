"""The one timing loop: prompts through the engine as one batch, wall-clock timed, each request's
counters kept; and every figure against `ar` is a ratio of two such runs in the same process.
`fly-serve bench` (methods.run_engine) and the one-off measurements (oneoff/) time through here."""

import time
from dataclasses import dataclass


@dataclass
class Timed:
    """One request of a timed batch."""

    params: dict  # what the request asked for (mode, k, ...)
    ids: list[int]  # the generated token ids
    text: str
    wall_s: float  # this request's share of its batch's wall time
    finish_reason: str | None
    error: str | None
    rounds: int
    drafted: int
    accepted: int
    loosely: int
    tau: float
    draft_s: float
    verify_s: float
    decide_s: float
    first_loose_pos: int | None
    grammar_cut: int = 0  # drafts cut because the request's grammar refused them (RequestStats)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def speedup_over(self, ar: "Timed") -> float:
        return self.tok_s / ar.tok_s if ar.tok_s > 0 else float("nan")

    def same_prefix(self, other: "Timed") -> int:
        """How many first tokens equal other's (all of the shorter, where one is a prefix)."""
        return next((i for i, (a, b) in enumerate(zip(self.ids, other.ids)) if a != b), min(self.tokens, other.tokens))

    def row(self, **extra) -> dict:
        """A JSON line: the params, then the figures (no ids, no text)."""
        return dict(
            self.params,
            tokens=self.tokens,
            wall_s=round(self.wall_s, 2),
            tok_s=round(self.tok_s, 2),
            tau=round(self.tau, 2),
            rounds=self.rounds,
            loosely=self.loosely,
            draft_s=round(self.draft_s, 2),
            verify_s=round(self.verify_s, 2),
            decide_s=round(self.decide_s, 4),
            **extra,
        )


def timed(engine, prompts: list, params: dict | list[dict]) -> list[Timed]:
    """`prompts` (token ids or text) as one batch of engine.generate, to the end; params: one dict
    for all or one per prompt. The batch's wall time is shared evenly by its requests."""
    per = params if isinstance(params, list) else [params] * len(prompts)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, per)
    wall = (time.perf_counter() - t0) / len(reqs)
    out = []
    for p, r in zip(per, reqs):
        s = r.stats
        out.append(
            Timed(
                dict(p),
                list(r.generated),
                r.text,
                wall,
                r.finish_reason,
                r.error,
                s.rounds,
                s.drafted,
                s.accepted,
                s.loosely_accepted,
                s.tau,
                s.draft_s,
                s.verify_s,
                s.decide_s,
                s.first_loose_pos,
                grammar_cut=s.grammar_cut,
            )
        )
    return out


def timed_one(engine, prompt, **params) -> Timed:
    """One prompt alone (batch 1)."""
    return timed(engine, [prompt], params)[0]
