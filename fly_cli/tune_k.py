"""`fly-serve tune-k`: what an operator needs before going live, for one target, one drafter and
this machine.

1. Cost curves: fly_serve.k_auto.cost_calibration.measure_profile, the measurement an engine runs at
   start (the target's verification seconds by tokens in its forward, the drafter's seconds per
   forward by rows), with this command's k_max, largest batch size and repetitions.
2. Acceptance. `fly` and `spd` at batch 1 with k = k_max on acceptance prompts (code, prose,
   math): per-token acceptance a = kept / (kept + rejections), as the policy's tracker counts it,
   the drafts per drafter forward (MLA) and the rest of a round's seconds (decide, commit).
3. The table. Per batch size B and k in 0..k_max, expected tokens/s = B * expected_emitted(k, a) /
   RoundCostModel(profile).round_s([k] * B): the best fixed k and its expected speedup over k = 0,
   then the measured speedup of that k against `ar` (same process, same prompts; where the best k
   is 0, of k = 1, so the prediction that drafting does not pay is checked too).
4. The profile: written to the cost-profile cache entry that build_engine(k_max=--k-max,
   max_batch=the largest batch size) reads on this machine (unless --no-cache), and printed as
   YAML for a Serve profile's `args:` (`speculation_profile:`, an override of the calibration).

Nothing here asserts a speed: the numbers are this machine's, printed for the operator.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import yaml

from fly_serve.config import EngineConfig
from fly_serve.k_auto.acceptance import expected_emitted
from fly_serve.k_auto.allocator import RowInfo
from fly_serve.k_auto.cost_calibration import calibration_key, measure_profile, save_cached
from fly_serve.k_auto.round_cost import MODEL, CostProfile, RoundCostModel

# Acceptance prompts: the kinds of text whose acceptance differs most (code repeats itself and
# the drafter guesses it well; prose and math less so).
ACCEPTANCE_PROMPTS = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals given as a list of "
    "[start, end] pairs and returns them sorted. Include a docstring and a few doctest examples.",
    "Explain to a new engineer, in a few plain paragraphs, what a race condition is, how one shows up in a web "
    "service, and the usual ways to prevent it.",
    "Solve step by step: a train leaves at 9:40 and travels 180 km at 72 km/h, then waits 15 minutes and travels "
    "another 96 km at 64 km/h. At what time does it arrive? Show each calculation.",
    "Write a C function that reverses a singly linked list in place, with a short comment on each step and a "
    "main() that tests it on a list of five nodes.",
)
QUICK_BATCH_SIZES = (1, 2)
QUICK_K_MAX = 3


# ---- settings
@dataclass
class Settings:
    batch_sizes: list[int]
    k_max: int
    reps: int  # passes over the cost curves' points (each keeps its fastest; a drafter difference the median)
    max_tokens: int  # per acceptance request
    measure_tokens: int  # per request of the measured speedup
    n_prompts: int  # acceptance prompts

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
        return Settings(list(QUICK_BATCH_SIZES), min(args.k_max, QUICK_K_MAX), 1, 8, 8, 1)
    return Settings(
        sorted(set(args.batch_sizes)), args.k_max, args.reps, args.max_tokens, args.measure_tokens, args.prompts
    )


# ---- acceptance
@dataclass
class Acceptance:
    """Counts over the acceptance requests of one mode (batch 1, fixed k)."""

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


def acceptance_prompts(tokenizer, n: int) -> list[list[int]]:
    from fly_serve.engine.prompts import chat_prompt

    return [chat_prompt(tokenizer, ACCEPTANCE_PROMPTS[i % len(ACCEPTANCE_PROMPTS)]) for i in range(n)]


def measure_acceptance(engine, prompts: list[list[int]], mode: str, k: int, max_tokens: int, bar) -> Acceptance:
    """Each prompt alone (batch 1) to max_tokens with a fixed k; the counts summed."""
    cal = Acceptance(mode, k)
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
def profile_yaml(profile: CostProfile, header: str = "") -> str:
    body = yaml.safe_dump({"speculation_profile": profile.to_dict()}, default_flow_style=None, sort_keys=False)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


# ---- the table
def expected_curve(
    cost: RoundCostModel, acceptance: float, tokens_per_forward: float, batch: int, k_max: int, overlap=False
):
    """Expected tokens/s of a batch whose every row drafts k, for k = 0..k_max (overlap: rounds
    with draft-ahead, round_cost.py)."""
    rates = []
    for k in range(k_max + 1):
        rows = [RowInfo(f"r{b}", k, MODEL, acceptance, tokens_per_forward) for b in range(batch)]
        rates.append(batch * expected_emitted(k, acceptance) / cost.round_s([k] * batch, rows, overlap))
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


def batch_rows(
    profile: CostProfile, fly: Acceptance, spd: Acceptance, batch_sizes: list[int], k_max: int, overlap=False
):
    cost = RoundCostModel(profile)
    return [
        BatchRow(
            b,
            expected_curve(cost, fly.acceptance, fly.tokens_per_forward, b, k_max, overlap),
            expected_curve(cost, spd.acceptance, spd.tokens_per_forward, b, k_max, overlap),
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


def format_summary(fly: Acceptance, spd: Acceptance, profile: CostProfile) -> str:
    lines = [
        f"acceptance per draft at k = {c.k} ({c.mode}): a = {c.acceptance:.3f} ({c.kept} kept, {c.rejections} "
        f"rejections, {c.rounds} rounds), {c.tokens_per_forward:.2f} drafts per drafter forward"
        for c in (fly, spd)
    ]
    p = profile.to_dict()
    v, d = p["verify"], p["draft"]
    lines.append(
        f"verify seconds by tokens: {dict(zip(v['tokens'], v['seconds']))}; drafter seconds per forward: "
        f"{d['per_forward']} + {d['per_row_forward']} per row, per drafting round {d['per_round']}; rest of "
        f"a round {p['overhead_s']}"
    )
    return "\n".join(lines)


# ---- the command
@dataclass
class TuneResult:
    settings: Settings
    profile: CostProfile
    fly: Acceptance
    spd: Acceptance
    rows: list[BatchRow] = field(default_factory=list)
    table: str = ""
    yaml: str = ""
    cache_path: str | None = None  # the cost-profile cache entry written


def add_args(p: argparse.ArgumentParser) -> None:
    from fly_cli.pair import add_pair

    add_pair(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes to profile")
    p.add_argument("--k-max", type=int, default=15, help="largest k profiled and tabulated")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per acceptance request")
    p.add_argument("--measure-tokens", type=int, default=48, help="tokens per request of the measured speedup")
    p.add_argument("--reps", type=int, default=3, help="passes over the cost curves' points (each keeps its fastest)")
    p.add_argument("--prompts", type=int, default=3, help="acceptance prompts (code, prose, math, ...)")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 1 and 2, k 0/1/3, 1 pass, 8 tokens")
    p.add_argument("--out", default=None, help="write the YAML here (default: stdout, after the table)")
    p.add_argument("--no-cache", action="store_true", help="do not write the cost-profile cache entry")
    p.add_argument(
        "--draft-ahead",
        action="store_true",
        help="profile draft-ahead: each side's curve timed while the other works, rounds costed as overlapped",
    )


def check_settings(s: Settings) -> None:
    if s.k_max < 1:
        raise SystemExit("error: --k-max must be >= 1")
    if min(s.batch_sizes) < 1:
        raise SystemExit("error: --batch-sizes must be >= 1")
    if min(s.reps, s.max_tokens, s.measure_tokens, s.n_prompts) < 1:
        raise SystemExit("error: --reps, --max-tokens, --measure-tokens, --prompts must be >= 1")


def run(args: argparse.Namespace) -> TuneResult:
    from tqdm import tqdm

    from fly_serve.build import build_engine

    started = time.perf_counter()
    s = settings_from(args)
    check_settings(s)
    log = lambda msg: print(f"[tune-k] {msg}", file=sys.stderr, flush=True)
    max_batch = max(s.batch_sizes)
    config = EngineConfig(
        target=args.target,
        drafter=args.drafter,
        dtype=args.dtype,
        drafter_precision=args.drafter_precision,
        drafter_head_cut=args.drafter_head_cut,
        max_batch=max_batch,
        draft_min_confidence=args.draft_min_confidence,
        draft_ahead=args.draft_ahead,
    )
    # calibrate=False: measured below, with this command's repetitions
    engine = build_engine(args.target, args.drafter, config=config, calibrate=False, progress=log)
    key = calibration_key(config, s.k_max)  # the entry build_engine with this config and k_max reads
    prompts = acceptance_prompts(engine.tokenizer, max(s.n_prompts, 1))
    steps = 2 * len(prompts) + 2 * len(s.batch_sizes)
    with tqdm(total=steps, desc="tune-k", file=sys.stderr, dynamic_ncols=True) as bar:
        curves = measure_profile(
            engine.scorer,
            engine.drafters["model"],
            k_max=s.k_max,
            max_batch=max_batch,
            reps=s.reps,
            progress=bar.write,
            stages=engine.stages,  # --draft-ahead: each side timed while the other works
        )
        fly = measure_acceptance(engine, prompts, "fly", s.k_max, s.max_tokens, bar)
        spd = measure_acceptance(engine, prompts, "spd", s.k_max, s.max_tokens, bar)
        overhead = statistics.median([fly.overhead_s, spd.overhead_s])
        profile = dataclasses.replace(curves, overhead_s=overhead, source="fly-serve tune-k")
        rows = batch_rows(profile, fly, spd, s.batch_sizes, s.k_max, overlap=engine.stages is not None)
        for r in rows:
            r.measured = measure_speedup(engine, prompts, r.batch, r.measured_k, s.measure_tokens, bar)
    header = (
        f"fly-serve tune-k: target {args.target} ({args.dtype}), drafter {args.drafter} ({args.drafter_precision}).\n"
        "An override of k: auto's calibration: paste under the Serve profile's args only to pin it."
    )
    result = TuneResult(s, profile, fly, spd, rows, format_table(rows, s.k_max), profile_yaml(profile, header))
    print(format_summary(fly, spd, profile) + "\n\n" + result.table + "\n", flush=True)
    if not args.no_cache:
        result.cache_path = str(save_cached(key, profile))
        log(
            f"cost profile cached in {result.cache_path} "
            f"(build_engine reads it with k_max {s.k_max}, max_batch {max_batch})"
        )
    if args.out:
        with open(args.out, "w") as f:
            f.write(result.yaml)
        log(f"profile written to {args.out}")
    else:
        print(result.yaml, end="", flush=True)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return result
