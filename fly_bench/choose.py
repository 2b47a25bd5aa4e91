"""`fly-serve bench --choose`: picking a default from a sweep of methods. Among the engine methods of
one temperature and batch size, the fastest whose recovery against `ar` keeps the point >= `point`
and the lower bound of its 95% interval >= `lower`, with the problems of every dataset pooled (more
problems, a tighter interval). Speed is the geometric mean over datasets of the speedup over `ar` of
the same dataset, so a dataset with long replies does not outweigh the others. Pure functions of
result records (store.py): tested on known inputs."""

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from .metrics import REFERENCE, against_ar, tok_s


@dataclass
class Candidate:
    method: str
    temperature: float
    batch: int
    problems: int  # pooled over datasets, those with an ar counterpart
    speedup: float  # geometric mean over datasets of tok/s over ar's
    recovery: float | None
    recovery_lo: float | None
    recovery_hi: float | None
    pass_to_fail: int  # samples (pooled) ar passes and the method fails, and the reverse
    fail_to_pass: int
    qualifies: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Choice:
    temperature: float
    batch: int
    lower: float
    point: float
    chosen: str | None  # None: no method qualifies
    candidates: list[Candidate]

    def as_dict(self) -> dict:
        return {**asdict(self), "candidates": [c.as_dict() for c in self.candidates]}


def geometric_speedup(records: list[dict], ar: list[dict]) -> float:
    by_dataset = defaultdict(list)
    for r in records:
        by_dataset[r["dataset"]].append(r)
    ratios = []
    for dataset, recs in by_dataset.items():
        base = tok_s([r for r in ar if r["dataset"] == dataset])
        if base > 0:
            ratios.append(tok_s(recs) / base)
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else 0.0


def _pooled(records: list[dict]) -> list[dict]:
    """The records with (dataset, problem) as their problem: one pool across datasets."""
    return [{**r, "problem": (r["dataset"], r["problem"])} for r in records]


def candidate(method: str, records: list[dict], ar: list[dict], lower: float, point: float, n_boot: int, seed: int):
    found = against_ar(_pooled(records), _pooled(ar), n_boot, seed)
    recovery, lo, hi = found.get("recovery"), found.get("recovery_lo"), found.get("recovery_hi")
    ok = recovery is not None and recovery >= point and lo >= lower
    first = records[0]
    return Candidate(
        method,
        first["temperature"],
        first["batch"],
        len({_key(r)[:2] for r in records}),
        geometric_speedup(records, ar),
        recovery,
        lo,
        hi,
        found.get("pass_to_fail", 0),
        found.get("fail_to_pass", 0),
        ok,
    )


def choose(
    records: list[dict],
    engine_methods: set[str],
    lower: float = 0.97,
    point: float = 0.99,
    n_boot: int = 2000,
    seed: int = 0,
) -> list[Choice]:
    """One Choice per (temperature, batch) that has ar and at least one other engine method, over
    the samples that every one of those methods has."""
    groups = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["method"] in engine_methods:
            groups[(r["temperature"], r["batch"])][r["method"]].append(r)
    choices = []
    for (temperature, batch), by_method in sorted(groups.items()):
        if REFERENCE not in by_method or len(by_method) < 2:
            continue
        # every candidate on the same samples (a partial run may hold more of some methods)
        shared = set.intersection(*({_key(r) for r in recs} for recs in by_method.values()))
        by_method = {m: [r for r in recs if _key(r) in shared] for m, recs in by_method.items()}
        ar = by_method[REFERENCE]
        others = sorted((m, recs) for m, recs in by_method.items() if m != REFERENCE)
        found = [candidate(m, recs, ar, lower, point, n_boot, seed) for m, recs in others]
        found.sort(key=lambda c: -c.speedup)
        chosen = next((c.method for c in found if c.qualifies), None)
        choices.append(Choice(temperature, batch, lower, point, chosen, found))
    return choices


def _key(record: dict) -> tuple:
    return record["dataset"], record["problem"], record["sample"]


def markdown(choices: list[Choice]) -> str:
    parts = []
    for ch in choices:
        lines = [
            f"Defaults from calibration (T={ch.temperature:g}, batch {ch.batch}; datasets pooled): the fastest "
            f"method with recovery >= {ch.point:g} and its lower 95% bound >= {ch.lower:g}: "
            f"**{ch.chosen or 'none qualifies'}**",
            "",
            "| method | problems | speedup (geo. mean) | recovery [95% CI] | flips -/+ | qualifies |",
            "|---|---|---|---|---|---|",
        ]
        for c in ch.candidates:
            rec = "-" if c.recovery is None else f"{c.recovery:.3f} [{c.recovery_lo:.3f}, {c.recovery_hi:.3f}]"
            ok = "yes" if c.qualifies else "no"
            lines.append(
                f"| {c.method} | {c.problems} | {c.speedup:.2f}x | {rec} | {c.pass_to_fail}/{c.fail_to_pass} | {ok} |"
            )
        lines.append(
            "\nA method without flips has the interval [1, 1] however few the problems: the bootstrap only "
            "resamples what was seen. With no loss in P problems that ar passes, a loss rate up to about 3/P "
            "is not excluded (rule of three), so read the choice with the number of problems."
        )
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + ("\n" if parts else "")
