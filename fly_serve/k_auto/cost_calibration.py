"""Measure k "auto"'s cost profile where the engine runs, once per machine, models and versions.

A profile measured on one machine is wrong on another (a CPU with bf16 instructions has another
curve than one without; a GPU another again), so none is baked into a default: the engine times
its own parts through the same protocols a round uses (contracts.Scorer / Drafter), in process
or through remote replicas alike, and caches the result under the fly-serve cache dir, keyed by
a hash of everything that changes the curve (calibration_key). `fly-serve tune-k` writes the same
entry. A profile given explicitly (`speculation_profile`) overrides it.

  target    seconds of one verification by its shape, as the engine runs it: B rows of T tokens
            each (the last token and T - 1 drafts, over a context), B = 1, 2, 4, ... max_batch,
            T = 1, 2, 4, ... k_max + 1 (the fastest of `reps` passes each). B one-token rows cost
            otherwise than one row of B tokens (each attends its own context), so the batch
            shapes are measured rather than read off a one-row curve (round_cost.BatchVerify).
            The one-row points and the rows of k_max drafts also make the token curve.
  drafter   seconds per batched forward by rows in it (B = 1, 2, 4, ... max_batch): drafting 1
            and DRAFT_K tokens per row, the difference is DRAFT_K - 1 forwards

Noise on a shared host only adds time, so each target shape keeps its fastest call (a drafter
point, a difference of two calls that noise moves either way, the median of its passes) and both
curves are the lower envelope of their points (lower_envelope): a 2-row forward timed slower than
a 4-row one costs what the 4-row one did.

Cost: (log2 max_batch + 2) x (log2 (k_max + 1) + 2) target shapes at most (20 for max_batch 8,
k_max 15), `reps` verifies each, plus two untimed ones; the drafter reps x (2 + DRAFT_K) forwards
per batch size. The shapes are timed in `reps` passes over all of them (each keeps its fastest),
so a drift of the host's speed over the minute reaches every shape alike.

The timing rows are dummies (random token ids, a short context) under their own keys; their KV
is released afterwards, so the requests that follow have the whole cache.
"""

import functools
import hashlib
import importlib.metadata as md
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from fly_serve.config import DRAFTER_GGUF_AUTO, DrafterSpec, EngineConfig
from fly_serve.contracts import Drafts, Row
from fly_serve.loading.weights import cache_dir
from fly_serve.runtime import onednn_linear

from .round_cost import BatchVerify, CostProfile, fit_per_forward

log = logging.getLogger("fly_serve.k_auto.cost_calibration")

# Bump when what a profile means changes: older cache entries are then ignored. The versions'
# history, with the figures that made each one, is in docs/journal.md ("cost profile format").
FORMAT = 8
DRAFT_K = 8  # drafts per row of the drafter's long call (the short one drafts 1)
CONTEXT_TOKENS = 16  # context of each timing row: a verify feeds its last token and drafts only
KEY_PREFIX = "calibrate-"
LOAD_KEY = KEY_PREFIX + "load"  # the row that keeps the other side busy (draft-ahead's curves)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_vnni")


# ---- what the profile depends on
def machine() -> dict:
    """This host as far as the cost curves care: CPU model and the flags of its matmul kernels,
    torch's threads, the GPU if any."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    cpu = value.strip()
                elif name.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cpu_flags": sorted(flags & set(CPU_FLAGS)),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "gpus": torch.cuda.device_count() if gpu else 0,
        # the fp32 linear kernels chosen at load in this process (a target in a replica of its
        # own chooses there, unseen here: its shape names the topology instead)
        "linear": onednn_linear.in_use(),
    }


def versions() -> dict:
    import transformers

    try:
        fly = md.version("fly-serve")
    except md.PackageNotFoundError:
        fly = "dev"
    try:
        llama = md.version("llama-cpp-python")
    except md.PackageNotFoundError:
        llama = None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama-cpp-python": llama,
        "fly-serve": fly,
        "format": FORMAT,
    }


def model_name(model) -> str | None:
    """A model's name for the key: as given, or a loaded model's own name or path."""
    if model is None or isinstance(model, str):
        return model
    return getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__


def drafters_key(config: EngineConfig, drafters: dict | None = None) -> str | None:
    """The drafters' part of the key, the one place it is made: the model's name alone for one
    drafter (the key of a single-drafter engine as it always was), name=model for several, the
    default first; a drafter of another tokenizer that drafts greedy rows by TLI says so (":tli":
    other work per draft than string-level). drafters: {name: DrafterSpec, model name or loaded
    model} as build_engine was given them, else the config's (EngineConfig.drafter_specs:
    `drafters` where set, else `drafter`)."""
    given = config.drafter_specs() if drafters is None else drafters
    models = {str(n): _drafter_name(d) for n, d in given.items()}
    if len(models) <= 1:
        return next(iter(models.values()), None)
    return ",".join(f"{n}={m}" for n, m in models.items())


def _drafter_name(drafter) -> str | None:
    if isinstance(drafter, DrafterSpec):
        return drafter.model if drafter.greedy == "string" else f"{drafter.model}:{drafter.greedy}"
    return model_name(drafter[0] if isinstance(drafter, tuple) else drafter)  # (model, tokenizer)


def calibration_key(config: EngineConfig, k_max: int, *, target=None, drafters=None, **shape) -> dict:
    """Everything a cost profile depends on, from the one config: the machine, the parts (the
    config's names; target / drafters: loaded parts where the config has no name, named by
    model_name: drafters_key), their precisions, the batch and k bounds, llama.cpp's kernel
    choice (reproducible: other kernels, another curve), the versions. shape: the serving shape
    (tp_size, threads per part, where the drafter runs ...), whatever else changes the curve."""
    from fly_serve.loading.loading import resolve_precision, resolve_runtime

    target_name = config.target if target is None else target
    runtime = resolve_runtime(config.runtime, target_name, progress=lambda _: None)
    return {
        "machine": machine(),
        "target": model_name(config.target if target is None else target),
        "drafter": drafters_key(config, drafters),
        "dtype": resolve_precision(config.dtype),
        "runtime": runtime,
        "drafter_precision": config.drafter_precision,
        # what a drafter's "auto" means on llama.cpp (its file requantized): named, so that a
        # profile timed with the drafter as shipped is not read for the requantized one
        **(
            {"drafter_gguf_auto": DRAFTER_GGUF_AUTO}
            if config.drafter_precision == "auto" and runtime == "llama.cpp"
            else {}
        ),
        "drafter_head_cut": config.drafter_head_cut,
        "max_batch": int(config.max_batch),
        "k_max": int(k_max),
        "versions": versions(),
        # named only when on: the keys of every other config stay as they were
        **({"reproducible": True} if config.reproducible else {}),
        **({"forward_split": False} if not config.forward_split else {}),  # one llama.cpp call a forward
        # draft-ahead's curves are timed with both sides busy (measure_profile's stages)
        **({"draft_ahead": [config.draft_threads, config.verify_threads]} if config.draft_ahead else {}),
        **({"extra": {k: shape[k] for k in sorted(shape)}} if shape else {}),
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(key: dict) -> Path:
    return cache_dir() / "cost-profiles" / f"{key_hash(key)}.json"


def load_cached(key: dict) -> CostProfile | None:
    """The cached profile of this key, None if there is none (or it cannot be read)."""
    path = cache_path(key)
    try:
        entry = json.loads(path.read_text())
        return (
            CostProfile.from_dict(entry["profile"])
            if entry.get("key") == json.loads(json.dumps(key, default=str))
            else None
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(key: dict, profile: CostProfile) -> Path:
    """Write the entry atomically (several processes may calibrate at once; the last one wins)."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "profile": profile.to_dict()}, indent=1, default=str))
    os.replace(tmp, path)
    return path


# ---- the measurement
def verify_points(k_max: int, max_batch: int) -> list[tuple[int, int]]:
    """(rows, k) of the token curve's points, a subset of batch_shapes: tokens 1, 2, 4, ... on one
    row up to k_max + 1, then 2, 4, ... rows of k_max drafts up to max_batch, each end measured."""
    rows, widths = batch_shapes(k_max, max_batch)
    return [(1, t - 1) for t in widths] + [(b, k_max) for b in rows if b > 1]


def batch_shapes(k_max: int, max_batch: int) -> tuple[list[int], list[int]]:
    """(rows, tokens per row) of the target's timed shapes: powers of two and each end,
    1 .. max_batch rows by 1 .. k_max + 1 tokens a row."""
    return _powers_to(max_batch), _powers_to(k_max + 1)


def _powers_to(n: int) -> list[int]:
    """1, 2, 4, ... and n itself (n >= 1)."""
    n = max(int(n), 1)
    return sorted({min(2**i, n) for i in range(n.bit_length() + 1)})


def timing_rows(n_rows: int, vocab: int, k: int, seed: int = 0) -> list[Row]:
    """Dummy greedy rows of CONTEXT_TOKENS random ids (different per row), drafting k, without
    MLA. entropy "topk": the target computes the gate's entropy too, as for loose `fly` rows. On
    the host it is computed at mismatches only (vocab_reads.gate_entropy) and these random drafts
    mismatch everywhere: a loose row's worst case there (~0.5 ms a position more than a round
    with few mismatches); strict rows, the served default's, compute none."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(vocab, (max(n_rows, 1), CONTEXT_TOKENS), generator=gen).tolist()  # [B, T]
    return [Row(f"{KEY_PREFIX}{b}", ctx[b], k, mla=False, entropy="topk") for b in range(n_rows)]


def _random_drafts(rows: list[Row], k: int, vocab: int, gen: torch.Generator) -> Drafts:
    return Drafts([torch.randint(vocab, (k,), generator=gen).tolist() for _ in rows], [None] * len(rows))


def time_verify(scorer, rows: list[Row], k: int, gen: torch.Generator) -> float:
    """Seconds of one verification of these rows with k fresh random drafts each. The calibration
    keeps each shape's fastest pass (measure_profile): the machine's cost without interference (a
    uniformly slower host does not change the plan)."""
    drafts = _random_drafts(rows, k, scorer.vocab_size, gen)
    t0 = time.perf_counter()
    scorer.verify(rows, drafts)
    return time.perf_counter() - t0


def time_draft(drafter, rows: list[Row]) -> tuple[float, float, float]:
    """One reading of the drafter on these rows: a call drafting 1 token a row, then one drafting
    DRAFT_K (made one after the other, so a slow spell of the host lands on both). Returns (seconds
    per batched forward: the difference over the forwards between, which noise may push to <= 0;
    seconds of a call beyond its forwards; the long call's plain average per forward). The
    calibration takes the median of its passes' readings (measure_profile)."""
    took = {}
    drafter.propose([Row(r.key, r.tokens, 1, mla=False) for r in rows])  # warm: prefill the rows
    for k in (1, DRAFT_K):
        call = [Row(r.key, r.tokens, k, mla=False) for r in rows]
        t0 = time.perf_counter()
        forwards = drafter.propose(call).forwards or k
        took[k] = (time.perf_counter() - t0, forwards)
    (t_lo, f_lo), (t_hi, f_hi) = took[1], took[DRAFT_K]
    per_forward = (t_hi - t_lo) / max(f_hi - f_lo, 1)
    return per_forward, max(t_lo - f_lo * max(per_forward, 0.0), 0.0), t_hi / max(f_hi, 1)


def lower_envelope(seconds) -> np.ndarray:
    """Each shape's time as at most that of every larger shape (more rows or more tokens never
    verify faster): a point above a larger one was slowed by something else on the host (noise
    here only adds time; the calibration keeps each point's fastest call for the same reason).
    seconds: [R, T] (or [N]), increasing shapes along each axis."""
    s = np.asarray(seconds, dtype=float)
    for axis in range(s.ndim):
        s = np.flip(np.minimum.accumulate(np.flip(s, axis), axis), axis)
    return s


def _under(stages, side: str, load, fn, *args):
    """fn(*args) (a timing), alone, or with draft-ahead's stages on `side`'s thread while the
    other side works (draft_ahead.Stages.under_load)."""
    return fn(*args) if stages is None else stages.under_load(side, functools.partial(fn, *args), load)


def measure_profile(
    scorer, drafter, *, k_max: int, max_batch: int, reps: int = 3, progress=print, stages=None, others=None
) -> CostProfile:
    """Time the target (and the drafter, if any) through their protocols in `reps` passes; a
    progress line per point and pass. The timing rows are released from both parts afterwards.
    stages (draft_ahead.Stages, an engine with draft-ahead): each side is timed on its own thread
    while the other side works on its own (a drafter drafting one row, a target verifying one row
    of k_max drafts), so the curves are what a draft-ahead round sees when the two share the
    machine. others: an engine's other model drafters by name, each timed as the drafter is (alone,
    after it), their e, c, d in the profile's `drafters`."""
    if reps < 1:
        raise ValueError(f"reps: at least one pass over the shapes (got {reps})")
    started = time.perf_counter()
    vocab = scorer.vocab_size
    batch_rows, widths = batch_shapes(k_max, max_batch)
    shapes = [(b, t) for b in batch_rows for t in widths]
    rows = timing_rows(max(batch_rows), vocab, 0)
    gen = torch.Generator().manual_seed(0)
    keys = [r.key for r in rows]
    try:
        scorer.verify(rows, Drafts.empty(len(rows)))  # prefill every timing row once (untimed)
        scorer.verify(rows[:1], _random_drafts(rows[:1], 1, vocab, gen))  # first-call warm-up
        grid: dict[tuple[int, int], float] = {}  # (rows, tokens per row) -> seconds
        load_gen = torch.Generator().manual_seed(1)
        stages = stages if drafter is not None else None
        load_row = replace(rows[0], key=LOAD_KEY)

        def draft_load():
            drafter.propose([replace(load_row, k=DRAFT_K)])

        def verify_load():
            scorer.verify([load_row], _random_drafts([load_row], k_max, vocab, load_gen))

        # Pass after pass over every shape, each shape keeping its fastest call: the VM's speed
        # drifts over minutes, and shapes timed one after the other would read that drift as
        # their difference (the 8-row shapes come last); a pass takes seconds.
        drafting = drafter is not None
        draft_passes: dict[int, list[tuple[float, float, float]]] = {b: [] for b in batch_rows}  # rows -> per pass
        others = dict(others or {}) if drafting else {}
        other_passes = {name: {b: [] for b in batch_rows} for name in others}
        done, total = 0, reps * (len(shapes) + (len(batch_rows) * (1 + len(others)) if drafting else 0))
        for n in range(1, reps + 1):
            for b, t in shapes:
                took = _under(stages, "verify", draft_load, time_verify, scorer, rows[:b], t - 1, gen)
                grid[b, t] = min(grid.get((b, t), took), took)
                done += 1
                progress(
                    f"calibrating k auto: pass {n}/{reps}, target, {b} rows x {t} tokens in a forward: "
                    f"{took * 1e3:.1f} ms ({done}/{total})"
                )
            for b in batch_rows if drafting else ():
                reading = _under(stages, "draft", verify_load, time_draft, drafter, rows[:b])
                draft_passes[b].append(reading)
                done += 1
                progress(
                    f"calibrating k auto: pass {n}/{reps}, drafter, {b} rows in a forward: "
                    f"{reading[0] * 1e3:.1f} ms ({done}/{total})"
                )
            for name, other in others.items():
                for b in batch_rows:
                    reading = time_draft(other, rows[:b])
                    other_passes[name][b].append(reading)
                    done += 1
                    progress(
                        f"calibrating k auto: pass {n}/{reps}, drafter {name}, {b} rows in a forward: "
                        f"{reading[0] * 1e3:.1f} ms ({done}/{total})"
                    )
        table = lower_envelope([[grid[b, t] for t in widths] for b in batch_rows])  # [R, T]
        grid = {(b, t): float(table[i, j]) for i, b in enumerate(batch_rows) for j, t in enumerate(widths)}
        points = verify_points(k_max, max_batch)  # the token curve: one row, then rows of k_max drafts
        tokens, seconds = [b * (k + 1) for b, k in points], [grid[b, k + 1] for b, k in points]
        e, c, d, draft_rows, draft_seconds = 0.0, 0.0, 0.0, [], []
        if drafting:
            draft_rows = list(batch_rows)
            e, c, d, draft_seconds = _draft_fit(draft_passes, batch_rows)
        other_costs = {}
        for name in others:
            oe, oc, od, _ = _draft_fit(other_passes[name], batch_rows)
            other_costs[name] = {"per_round": oe, "per_forward": oc, "per_row_forward": od}
    finally:
        for part in (scorer, drafter, *(others or {}).values()):
            if part is not None:
                part.release([*keys, LOAD_KEY])
    took = time.perf_counter() - started
    progress(f"calibrating k auto: done in {took:.1f} s")
    return CostProfile(
        tokens,
        seconds,
        e,
        c,
        d,
        0.0,
        "measured",
        {
            "draft_rows": draft_rows,
            "draft_seconds": [float(f"{s:.6g}") for s in draft_seconds],
            "took_s": round(took, 2),
            **({"overlap": True} if stages is not None else {}),
        },
        BatchVerify(batch_rows, widths, [[grid[b, t] for t in widths] for b in batch_rows]),
        other_costs,
    )


def _draft_fit(passes: dict[int, list[tuple[float, float, float]]], batch_rows: list[int]):
    """(e, c, d, seconds per forward by rows) of one drafter's readings. A per-forward cost is a
    difference of two calls, so noise can move it either way: the median of the passes (where
    noise swamped it, <= 0: the plain average instead), then the lower envelope across row counts."""
    per_pass = [passes[b] for b in batch_rows]
    medians = [statistics.median(f for f, _, _ in p) for p in per_pass]
    medians = [m if m > 0 else statistics.median(a for _, _, a in p) for m, p in zip(medians, per_pass)]
    seconds = [float(x) for x in lower_envelope(medians)]
    c, d = fit_per_forward(batch_rows, seconds)
    e = statistics.median(x for p in per_pass for _, x, _ in p)
    return e, c, d, seconds


# ---- the engine's entry point
def calibrate_engine(
    engine, key: dict, *, reps: int = 3, refresh: bool = False, cache: bool = True, progress=print
) -> CostProfile:
    """Load this key's profile from the cache or measure it through the engine's parts (and cache
    it); either way install it into engine.policy (frozen until the next call). refresh: measure
    even if cached. Call it once the engine's parts are up (a serving layer: after its remote
    replicas answer), before requests run. key: calibration_key(...). A cached profile that lacks
    one of the engine's other drafters (its `drafters`) is measured again: that drafter would be
    priced as the default."""
    profile = None if refresh or not cache else load_cached(key)
    others = set(getattr(engine, "others", None) or {})
    if profile is not None and others - set(profile.drafters):  # an entry made without them: measure
        progress(f"k auto: the cached profile lacks drafters {', '.join(sorted(others - set(profile.drafters)))}")
        profile = None
    if profile is not None:
        progress(f"k auto: cost profile from the cache ({cache_path(key)})")
    else:
        profile = measure_profile(
            engine.scorer,
            engine.drafters.get("model"),
            others=getattr(engine, "others", None),
            k_max=int(key["k_max"]),
            max_batch=int(key["max_batch"]),
            reps=reps,
            progress=progress,
            stages=engine.stages,  # draft-ahead: each side timed while the other works
        )
        if cache:
            progress(f"k auto: cost profile cached in {save_cached(key, profile)}")
    engine.policy.set_profile(profile, measured_here=True)  # frozen: no cost check (speculation_policy.py)
    return profile
