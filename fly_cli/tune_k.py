"""`fly-serve tune-k`: what an operator needs before going live, for one target, one drafter and
this machine.

1. Cost curves. The target's verification seconds vs tokens in its forward, for every batch size
   and k of a grid: `scorer.verify` on rows whose KV cache already holds a real context, with fresh
   random drafts each time (the content-addressed cache keeps the prefix, so only the last token
   and the drafts are fed, as in a round). The drafter's seconds per forward vs rows:
   `ModelDrafter.propose` without MLA on warm rows at two drafting lengths, whose difference is
   the cost of the extra forwards (and the rest, the drafter's cost per drafting round).
2. Acceptance. `fly` and `spd` at batch 1 with k = k_max on calibration prompts (code, prose,
   math): per-token acceptance a = kept / (kept + rejections), as the policy's tracker counts it,
   the drafts per drafter forward (MLA) and the rest of a round's seconds (decide, commit).
3. The table. Per batch size B and k in 0..k_max, expected tokens/s = B * expected_emitted(k, a) /
   RoundCostModel(profile).round_s([k] * B): the best fixed k and its expected speedup over k = 0,
   then the measured speedup of that k against `ar` (same process, same prompts; where the best k
   is 0, of k = 1, so the prediction that drafting does not pay is checked too).
4. The profile, as YAML to paste under a Serve profile's `args:` (`speculation_profile:`).

Nothing here asserts a speed: the numbers are this machine's, printed for the operator.
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import yaml

from fly_serve.contracts import Drafts, Row
from fly_serve.speculation_policy import MODEL, RoundCostModel, RowInfo, expected_emitted

# Calibration prompts: the kinds of text whose acceptance differs most (code repeats itself and
# the drafter guesses it well; prose and math less so).
CALIBRATION_PROMPTS = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals given as a list of "
    "[start, end] pairs and returns them sorted. Include a docstring and a few doctest examples.",
    "Explain to a new engineer, in a few plain paragraphs, what a race condition is, how one shows up in a web "
    "service, and the usual ways to prevent it.",
    "Solve step by step: a train leaves at 9:40 and travels 180 km at 72 km/h, then waits 15 minutes and travels "
    "another 96 km at 64 km/h. At what time does it arrive? Show each calculation.",
    "Write a C function that reverses a singly linked list in place, with a short comment on each step and a "
    "main() that tests it on a list of five nodes.",
)
DRAFT_K = 4  # drafts per row when timing the drafter; compared with one draft
QUICK_BATCH_SIZES = (1, 2)
QUICK_K_MAX = 3


# ---- settings
@dataclass
class Settings:
    batch_sizes: list[int]
    k_max: int
    reps: int  # timed repetitions per point (the median is kept)
    max_tokens: int  # per calibration request
    measure_tokens: int  # per request of the measured speedup
    n_prompts: int  # calibration prompts
    context_tokens: int  # context of the rows the cost curves time

    @property
    def k_grid(self) -> list[int]:
        return k_grid(self.k_max)


def k_grid(k_max: int) -> list[int]:
    """0, 1, 3, 7, 15, ... up to k_max, and k_max itself: denser where the curves bend (few
    tokens), with the far end measured rather than extrapolated."""
    grid = [k for k in (2**i - 1 for i in range(k_max.bit_length() + 1)) if k <= k_max]
    return grid if grid[-1] == k_max else [*grid, k_max]


def settings_from(args: argparse.Namespace) -> Settings:
    if args.quick:  # a smoke run: the whole pipeline, each part at its smallest
        return Settings(list(QUICK_BATCH_SIZES), min(args.k_max, QUICK_K_MAX), 1, 8, 8, 1, args.context_tokens)
    return Settings(
        sorted(set(args.batch_sizes)),
        args.k_max,
        args.reps,
        args.max_tokens,
        args.measure_tokens,
        args.prompts,
        args.context_tokens,
    )


# ---- cost curves
@dataclass
class VerifyPoint:
    batch: int
    k: int
    seconds: list[float]  # one per timed repetition

    @property
    def tokens(self) -> int:
        return self.batch * (self.k + 1)


@dataclass
class DraftPoint:
    rows: int
    per_forward_s: float  # seconds one more batched drafter forward adds
    per_round_s: float  # seconds of a drafting call beyond its forwards (catch-up, Python)


def timing_contexts(prompts: list[list[int]], n_rows: int, length: int) -> list[list[int]]:
    """Row b's context: the calibration prompts, starting at prompt b, cycled to `length` tokens
    (real text of a realistic length; the rows differ where there are several prompts)."""
    out = []
    for b in range(n_rows):
        tokens: list[int] = []
        while len(tokens) < length:
            for i in range(len(prompts)):
                tokens += prompts[(b + i) % len(prompts)]
        out.append(tokens[:length])
    return out


def timing_rows(contexts: list[list[int]], batch: int, k: int, entropy: str | None = "topk") -> list[Row]:
    """The first `batch` contexts as greedy rows drafting k; entropy "topk": the target computes
    the gate's entropy, as for `fly` rows. The keys are reused across batch sizes, so the caches
    hold at most max(batch sizes) timing rows."""
    return [Row(f"tune-k-{b}", contexts[b], k, mla=False, entropy=entropy) for b in range(batch)]


def random_drafts(rows: list[Row], k: int, vocab: int, gen: torch.Generator) -> Drafts:
    return Drafts([torch.randint(vocab, (k,), generator=gen).tolist() for _ in rows], [None] * len(rows))


def time_verify(scorer, rows: list[Row], k: int, reps: int, gen: torch.Generator) -> list[float]:
    """Seconds of scorer.verify on these rows with k fresh drafts each, `reps` times. The first
    call (untimed) prefills rows new to the cache; after it each call feeds exactly the last
    token and the k drafts of every row."""
    scorer.verify(rows, random_drafts(rows, k, scorer.vocab_size, gen))
    seconds = []
    for _ in range(reps):
        drafts = random_drafts(rows, k, scorer.vocab_size, gen)
        t0 = time.perf_counter()
        scorer.verify(rows, drafts)
        seconds.append(time.perf_counter() - t0)
    return seconds


def time_propose(drafter, rows: list[Row], reps: int) -> tuple[float, int]:
    """Median seconds of drafter.propose on these rows, and the forwards one call takes. One
    untimed call first warms the drafter's cache with the rows."""
    drafter.propose(rows)
    seconds, forwards = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        forwards = drafter.propose(rows).forwards
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), forwards


def draft_point(drafter, contexts: list[list[int]], batch: int, reps: int) -> DraftPoint:
    """Drafting 1 vs DRAFT_K tokens per row without MLA (one token per forward): the difference
    is the extra forwards' seconds; what one forward leaves of the short call is per round."""
    t_lo, f_lo = time_propose(drafter, timing_rows(contexts, batch, 1, None), reps)
    t_hi, f_hi = time_propose(drafter, timing_rows(contexts, batch, DRAFT_K, None), reps)
    per_forward = (t_hi - t_lo) / max(f_hi - f_lo, 1)
    if per_forward <= 0:  # timing noise swamped the difference: the plain average instead
        per_forward = t_hi / max(f_hi, 1)
    return DraftPoint(batch, per_forward, max(t_lo - f_lo * per_forward, 0.0))


# ---- acceptance
@dataclass
class Calibration:
    """Counts over the calibration requests of one mode (batch 1, fixed k)."""

    mode: str
    k: int
    kept: int = 0  # drafts kept: accepted + loosely accepted
    rejections: int = 0  # rounds that ended at a rejected draft (a recovered token)
    drafted: int = 0
    forwards: int = 0  # drafter forwards
    rounds: int = 0
    emitted: int = 0
    other_s: float = 0.0  # wall seconds of the rounds outside draft and verify

    @property
    def acceptance(self) -> float:
        """Per-token acceptance under the geometric model: a round stops at its first rejection,
        so kept / (kept + rejections), not kept / drafted."""
        n = self.kept + self.rejections
        return self.kept / n if n else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Drafts per drafter forward (1 without MLA; more where lookup proposals pass)."""
        return max(1.0, self.drafted / self.forwards) if self.forwards else 1.0

    @property
    def overhead_s(self) -> float:
        return self.other_s / self.rounds if self.rounds else 0.0


def calibration_prompts(tokenizer, n: int) -> list[list[int]]:
    from fly_serve.prompts import chat_prompt

    return [chat_prompt(tokenizer, CALIBRATION_PROMPTS[i % len(CALIBRATION_PROMPTS)]) for i in range(n)]


def calibrate(engine, prompts: list[list[int]], mode: str, k: int, max_tokens: int, bar) -> Calibration:
    """Each prompt alone (batch 1) to max_tokens with a fixed k; the counts summed."""
    cal = Calibration(mode, k)
    drafter = engine.drafters["model"]
    for prompt in prompts:
        bar.set_postfix_str(f"{mode} k={k}")
        forwards = drafter.forwards
        req = engine.add(prompt, dict(mode=mode, k=k, max_tokens=max_tokens, temperature=0.0))
        t0 = time.perf_counter()
        while not req.finished:
            engine.step()
        wall = time.perf_counter() - t0
        s = req.stats
        cal.kept += s.accepted + s.loosely_accepted
        cal.rejections += s.recovered
        cal.drafted += s.drafted
        cal.forwards += drafter.forwards - forwards
        cal.rounds += s.rounds
        cal.emitted += s.emitted
        cal.other_s += max(wall - s.draft_s - s.verify_s, 0.0)
        bar.update()
    return cal


# ---- the profile
def _sig(x: float) -> float:
    return float(f"{x:.6g}")


def build_profile(verify: list[VerifyPoint], draft: list[DraftPoint], overhead_s: float) -> dict:
    """RoundCostModel's profile: verify knots at the distinct token counts (the median of every
    repetition at that count, whatever batch and k gave it: the model reads tokens only), the
    drafter's seconds per forward by rows, its per-round seconds (median over batch sizes)."""
    by_tokens: dict[int, list[float]] = {}
    for p in verify:
        by_tokens.setdefault(p.tokens, []).extend(p.seconds)
    tokens = sorted(by_tokens)
    return {
        "verify": {"tokens": tokens, "seconds": [_sig(statistics.median(by_tokens[n])) for n in tokens]},
        "draft": {
            "rows": [p.rows for p in draft],
            "seconds": [_sig(p.per_forward_s) for p in draft],
            "per_round": _sig(statistics.median(p.per_round_s for p in draft)),
        },
        "overhead_s": _sig(overhead_s),
    }


def profile_yaml(profile: dict, header: str = "") -> str:
    body = yaml.safe_dump({"speculation_profile": profile}, default_flow_style=None, sort_keys=False)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


# ---- the table
def expected_curve(cost: RoundCostModel, acceptance: float, tokens_per_forward: float, batch: int, k_max: int):
    """Expected tokens/s of a batch whose every row drafts k, for k = 0..k_max."""
    rates = []
    for k in range(k_max + 1):
        rows = [RowInfo(f"r{b}", k, MODEL, acceptance, tokens_per_forward) for b in range(batch)]
        rates.append(batch * expected_emitted(k, acceptance) / cost.round_s([k] * batch, rows))
    return rates


def best_k(rates: list[float]) -> int:
    """The k of the highest rate; the smallest such k on a tie (fewer drafts, less at risk)."""
    return int(np.argmax(rates))


@dataclass
class Measured:
    ar_tokens_per_s: float
    fly_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.fly_tokens_per_s / self.ar_tokens_per_s if self.ar_tokens_per_s > 0 else float("nan")


@dataclass
class BatchRow:
    batch: int
    rates: list[float]  # fly, expected tokens/s for k = 0..k_max
    spd_rates: list[float]
    measured: Measured | None = None  # fly at measured_k against ar

    @property
    def measured_k(self) -> int:
        """The k measured against ar: the best, or 1 where the best is 0 (plain decoding is ar)."""
        return max(self.best_k, 1)

    @property
    def best_k(self) -> int:
        return best_k(self.rates)

    @property
    def expected_speedup(self) -> float:
        return self.rates[self.best_k] / self.rates[0]

    @property
    def spd_best_k(self) -> int:
        return best_k(self.spd_rates)

    @property
    def spd_expected_speedup(self) -> float:
        return self.spd_rates[self.spd_best_k] / self.spd_rates[0]


def batch_rows(profile: dict, fly: Calibration, spd: Calibration, batch_sizes: list[int], k_max: int):
    cost = RoundCostModel(profile)
    return [
        BatchRow(
            b,
            expected_curve(cost, fly.acceptance, fly.tokens_per_forward, b, k_max),
            expected_curve(cost, spd.acceptance, spd.tokens_per_forward, b, k_max),
        )
        for b in batch_sizes
    ]


def decode_tokens_per_s(engine, prompts: list[list[int]], params: dict) -> float:
    """Tokens/s of these prompts run together, from the end of the first round: that round
    prefills every prompt, the same work in any mode and outside the round model (unless it is
    the only round)."""
    reqs = [engine.add(p, params) for p in prompts]
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    first = sum(r.stats.emitted for r in reqs)
    if all(r.finished for r in reqs):
        return first / (t1 - t0)
    while not all(r.finished for r in reqs):
        engine.step()
    return (sum(r.stats.emitted for r in reqs) - first) / (time.perf_counter() - t1)


def measure_speedup(engine, prompts: list[list[int]], batch: int, k: int, max_tokens: int, bar) -> Measured:
    """`fly` at fixed k against `ar` on the same `batch` prompts (cycled), in this process."""
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    base = dict(max_tokens=max_tokens, temperature=0.0)
    bar.set_postfix_str(f"B={batch} ar")
    ar = decode_tokens_per_s(engine, chosen, dict(base, mode="ar"))
    bar.update()
    bar.set_postfix_str(f"B={batch} fly k={k}")
    fly = decode_tokens_per_s(engine, chosen, dict(base, mode="fly", k=k))
    bar.update()
    return Measured(ar, fly)


def format_table(rows: list[BatchRow], k_max: int) -> str:
    grid = sorted(set(k_grid(k_max)))
    lines = [
        "| batch | best k | expected speedup | measured speedup (k: measured, expected; ar -> fly tok/s) "
        "| spd: best k, expected "
        f"| expected tok/s by k ({', '.join(map(str, grid))}) |",
        "|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        m = r.measured
        km = r.measured_k
        measured = (
            "-"
            if m is None
            else f"k={km}: {m.speedup:.2f}x, {r.rates[km] / r.rates[0]:.2f}x "
            f"({m.ar_tokens_per_s:.3g} -> {m.fly_tokens_per_s:.3g})"
        )
        curve = " ".join(f"{k}:{r.rates[k]:.3g}" for k in grid)
        lines.append(
            f"| {r.batch} | {r.best_k} ({r.rates[r.best_k]:.3g} tok/s) | {r.expected_speedup:.2f}x | {measured} "
            f"| {r.spd_best_k}, {r.spd_expected_speedup:.2f}x | {curve} |"
        )
    return "\n".join(lines)


def format_summary(fly: Calibration, spd: Calibration, profile: dict) -> str:
    lines = [
        f"acceptance per draft at k = {c.k} ({c.mode}): a = {c.acceptance:.3f} ({c.kept} kept, {c.rejections} "
        f"rejections, {c.rounds} rounds), {c.tokens_per_forward:.2f} drafts per drafter forward"
        for c in (fly, spd)
    ]
    v, d = profile["verify"], profile["draft"]
    lines.append(
        f"verify seconds by tokens: {dict(zip(v['tokens'], v['seconds']))}; drafter seconds per forward by "
        f"rows: {dict(zip(d['rows'], d['seconds']))}, per drafting round {d['per_round']}; rest of a round "
        f"{profile['overhead_s']}"
    )
    return "\n".join(lines)


# ---- the command
@dataclass
class TuneResult:
    settings: Settings
    profile: dict
    fly: Calibration
    spd: Calibration
    rows: list[BatchRow] = field(default_factory=list)
    table: str = ""
    yaml: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    from fly_cli.pair import add_pair

    add_pair(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes to profile")
    p.add_argument("--k-max", type=int, default=15, help="largest k profiled and tabulated")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per calibration request")
    p.add_argument("--measure-tokens", type=int, default=48, help="tokens per request of the measured speedup")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median)")
    p.add_argument("--prompts", type=int, default=3, help="calibration prompts (code, prose, math, ...)")
    p.add_argument("--context-tokens", type=int, default=200, help="context of the rows the cost curves time")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 1 and 2, k 0/1/3, 1 rep, 8 tokens")
    p.add_argument("--out", default=None, help="write the YAML here (default: stdout, after the table)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random drafts")


def check_settings(s: Settings) -> None:
    if s.k_max < 1:
        raise SystemExit("error: --k-max must be >= 1")
    if min(s.batch_sizes) < 1:
        raise SystemExit("error: --batch-sizes must be >= 1")
    if min(s.reps, s.max_tokens, s.measure_tokens, s.n_prompts, s.context_tokens) < 1:
        raise SystemExit("error: --reps, --max-tokens, --measure-tokens, --prompts, --context-tokens must be >= 1")


def measure_curves(engine, s: Settings, prompts: list[list[int]], gen: torch.Generator, bar):
    contexts = timing_contexts(prompts, max(s.batch_sizes), s.context_tokens)
    verify = []
    for b in s.batch_sizes:
        for k in s.k_grid:
            bar.set_postfix_str(f"verify B={b} k={k}")
            verify.append(VerifyPoint(b, k, time_verify(engine.scorer, timing_rows(contexts, b, k), k, s.reps, gen)))
            bar.update()
    draft = []
    drafter = engine.drafters["model"]
    for b in s.batch_sizes:
        bar.set_postfix_str(f"drafter B={b}")
        draft.append(draft_point(drafter, contexts, b, s.reps))
        bar.update()
    keys = [r.key for r in timing_rows(contexts, max(s.batch_sizes), 0)]
    engine.scorer.release(keys)  # the timing rows' slots go back to the requests that follow
    drafter.release(keys)
    return verify, draft


def run(args: argparse.Namespace) -> TuneResult:
    from tqdm import tqdm

    from fly_serve.build import build_engine

    started = time.perf_counter()
    s = settings_from(args)
    check_settings(s)
    log = lambda msg: print(f"[tune-k] {msg}", file=sys.stderr, flush=True)
    engine = build_engine(
        args.target,
        args.drafter,
        dtype=args.dtype,
        drafter_precision=args.drafter_precision,
        drafter_head_cut=args.drafter_head_cut,
        max_batch=max(s.batch_sizes),
        draft_min_confidence=args.draft_min_confidence,
        progress=log,
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompts = calibration_prompts(engine.tokenizer, max(s.n_prompts, 1))
    steps = len(s.batch_sizes) * (len(s.k_grid) + 1) + 2 * len(prompts) + 2 * len(s.batch_sizes)
    with tqdm(total=steps, desc="tune-k", file=sys.stderr, dynamic_ncols=True) as bar:
        verify, draft = measure_curves(engine, s, prompts, gen, bar)
        fly = calibrate(engine, prompts, "fly", s.k_max, s.max_tokens, bar)
        spd = calibrate(engine, prompts, "spd", s.k_max, s.max_tokens, bar)
        profile = build_profile(verify, draft, statistics.median([fly.overhead_s, spd.overhead_s]))
        rows = batch_rows(profile, fly, spd, s.batch_sizes, s.k_max)
        for r in rows:
            r.measured = measure_speedup(engine, prompts, r.batch, r.measured_k, s.measure_tokens, bar)
    header = (
        f"fly-serve tune-k: target {args.target} ({args.dtype}), drafter {args.drafter} ({args.drafter_precision}).\n"
        "Paste under the Serve profile's args: (seeds k: auto's round cost model)."
    )
    result = TuneResult(s, profile, fly, spd, rows, format_table(rows, s.k_max), profile_yaml(profile, header))
    print(format_summary(fly, spd, profile) + "\n\n" + result.table + "\n", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(result.yaml)
        log(f"profile written to {args.out}")
    else:
        print(result.yaml, end="", flush=True)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return result
