"""Figures from result records (store.py), per dataset, temperature, batch size and method, each
against `ar` of the same dataset, temperature and batch size (hf peers run at batch 1: against `ar`
at batch 1), and its speed against llama.cpp's plain `llama-server` there too where the run has
it. Pure functions of the records: tested on known inputs."""

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

REFERENCE = "ar"
PEER_REFERENCE = "llama-server"  # llama.cpp's plain decoding on the same files (methods.LLAMA_SERVER_PEERS)


@dataclass
class Row:
    dataset: str
    temperature: float
    batch: int
    method: str
    runtime: str | None  # where its samples ran (records' "runtime"; None: older results)
    problems: int
    samples: int
    tokens: int
    wall_s: float
    tok_s: float
    speedup: float | None  # tok/s over ar's, same run
    vs_peer: float | None  # tok/s over llama-server's (PEER_REFERENCE), same run
    tau: float | None  # tokens per round (engine methods)
    loosely: int | None
    accuracy: float
    recovery: float | None  # accuracy / accuracy of ar
    recovery_lo: float | None  # paired bootstrap over problems, 95%
    recovery_hi: float | None
    identical: int | None  # samples whose tokens equal ar's
    compared: int | None  # samples with an ar counterpart
    pass_to_fail: int | None
    fail_to_pass: int | None
    divergence_median: float | None  # first token where the output parts from ar's
    diverged_early: int | None  # ... of those, how many within the first EARLY tokens
    with_loose: int | None = None  # samples with a loose accept (engine methods)
    first_loose_median: float | None = None  # output position of the first loosely accepted token
    loose_early: int | None = None  # ... of those, how many within the first EARLY tokens
    # True: every position is exact (first_loose_pos); False: some are the start of the round
    # that made the first loose accept (results written before the engine reported the position)
    first_loose_exact: bool | None = None
    flipped: list = field(default_factory=list)  # [(problem, sample, direction, divergence)]

    def as_dict(self) -> dict:
        return asdict(self)


EARLY = 8


def paired_bootstrap_ratio(
    a: np.ndarray, b: np.ndarray, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Interval of mean(a) / mean(b) from resampling problems (pairs (a_i, b_i) stay together);
    resamples where mean(b) = 0 are dropped. NaNs where nothing is left."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) != len(b) or len(a) == 0:
        raise ValueError("paired_bootstrap_ratio: a and b must be non-empty and of equal length")
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))
    num, den = a[idx].mean(1), b[idx].mean(1)
    ratios = num[den > 0] / den[den > 0]
    if ratios.size == 0:
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (the shorter one's length if one is a
    prefix of the other), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def flips(pairs: list[tuple[float, float]]) -> tuple[int, int]:
    """(pass -> fail, fail -> pass) over (ar score, method score) pairs; pass = score 1."""
    down = sum(1 for r, m in pairs if r == 1 and m < 1)
    up = sum(1 for r, m in pairs if r < 1 and m == 1)
    return down, up


def per_problem_means(records: list[dict]) -> dict[str, float]:
    """Mean score over a problem's samples."""
    scores = defaultdict(list)
    for r in records:
        scores[r["problem"]].append(r["score"])
    return {p: float(np.mean(s)) for p, s in scores.items()}


def tok_s(records: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in records)
    return sum(r["tokens"] for r in records) / wall if wall > 0 else 0.0


def against_ar(records: list[dict], ar: list[dict], n_boot: int, seed: int) -> dict:
    """The figures that compare a method with ar on the samples both have."""
    ar_by = {(r["problem"], r["sample"]): r for r in ar}
    pairs = [(ar_by[(r["problem"], r["sample"])], r) for r in records if (r["problem"], r["sample"]) in ar_by]
    if not pairs:
        return {}
    mine, ref = per_problem_means([m for _, m in pairs]), per_problem_means([a for a, _ in pairs])
    problems = sorted(mine)
    a = np.array([mine[p] for p in problems])
    b = np.array([ref[p] for p in problems])
    recovery = float(a.mean() / b.mean()) if b.mean() > 0 else None
    lo, hi = paired_bootstrap_ratio(a, b, n_boot, seed) if recovery is not None else (None, None)
    divergence = {(m["problem"], m["sample"]): first_divergence(m["token_ids"], r["token_ids"]) for r, m in pairs}
    parted = [d for d in divergence.values() if d is not None]
    down, up = flips([(r["score"], m["score"]) for r, m in pairs])
    flipped = [
        (m["problem"], m["sample"], "pass->fail" if r["score"] == 1 else "fail->pass", divergence[key])
        for r, m in pairs
        if (r["score"] == 1) != (m["score"] == 1)
        for key in [(m["problem"], m["sample"])]
    ]
    return dict(
        recovery=recovery,
        recovery_lo=lo,
        recovery_hi=hi,
        identical=len(pairs) - len(parted),
        compared=len(pairs),
        pass_to_fail=down,
        fail_to_pass=up,
        divergence_median=float(np.median(parted)) if parted else None,
        diverged_early=sum(d < EARLY for d in parted),
        flipped=flipped,
    )


def first_loose_position(record: dict) -> tuple[int | None, bool]:
    """(output position of the sample's first loose accept or None, whether it is exact). A record
    with `first_loose_pos` has the exact position; an older one only [start, end) of the round
    that made it (`first_loose`), whose start stands in for it."""
    if "first_loose_pos" in record:
        return record["first_loose_pos"], True
    span = record.get("first_loose")
    return (span[0] if span else None), False


def loose_positions(records: list[dict]) -> dict:
    """Where the first loose accept happened, over the samples that had one."""
    if all(r.get("rounds") is None for r in records):
        return {}
    found = [first_loose_position(r) for r in records]
    starts = [pos for pos, _ in found if pos is not None]
    return dict(
        with_loose=len(starts),
        first_loose_median=float(np.median(starts)) if starts else None,
        loose_early=sum(s < EARLY for s in starts),
        first_loose_exact=all(exact for pos, exact in found if pos is not None) if starts else None,
    )


def summarize(records: list[dict], n_boot: int = 2000, seed: int = 0) -> list[Row]:
    groups = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["temperature"], r["batch"], r["method"])].append(r)
    rows = []
    for (dataset, temperature, batch, method), recs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        ar = groups.get((dataset, temperature, batch, REFERENCE), [])
        peer = groups.get((dataset, temperature, batch, PEER_REFERENCE), [])
        rounds = [r["rounds"] for r in recs if r.get("rounds") is not None]
        runtimes = sorted({r["runtime"] for r in recs if r.get("runtime")})
        base = dict(
            dataset=dataset,
            temperature=temperature,
            batch=batch,
            method=method,
            runtime=", ".join(runtimes) or None,
            problems=len({r["problem"] for r in recs}),
            samples=len(recs),
            tokens=sum(r["tokens"] for r in recs),
            wall_s=round(sum(r["wall_s"] for r in recs), 3),
            tok_s=tok_s(recs),
            speedup=tok_s(recs) / tok_s(ar) if ar and tok_s(ar) > 0 else None,
            vs_peer=tok_s(recs) / tok_s(peer) if peer and tok_s(peer) > 0 else None,
            tau=sum(r["tokens"] for r in recs) / sum(rounds) if rounds and sum(rounds) else None,
            loosely=sum(r.get("loosely") or 0 for r in recs) if rounds else None,
            accuracy=float(np.mean(list(per_problem_means(recs).values()))),
        )
        compared = {**(against_ar(recs, ar, n_boot, seed) if ar else {}), **loose_positions(recs)}
        empty = {f: None for f in Row.__dataclass_fields__ if f not in base and f != "flipped"}
        rows.append(Row(**base, **{**empty, **compared}))
    return rows


def _order(key: tuple) -> tuple:
    dataset, temperature, batch, method = key
    return (dataset, temperature, batch, method != REFERENCE, method)
