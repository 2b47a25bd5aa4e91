"""How many llama_decode calls carry a forward of n tokens: measured where it runs, cached.

llama.cpp's CPU kernels change with the width of a forward (the tokens in one llama_decode: a
batch's rows and each row's drafts together): its repacked gemm takes >= 4 rows, its tiled
K-quant matmul >= 8, and the cost per token does not fall evenly with the width: on a 2-core
AMD EPYC a forward of 8 tokens cost more in one call than as two of 4 (docs/journal.md, "A
forward of 8 tokens"), so every 8-user plain step paid for its shape, as llama-server's does.

So the runner splits a forward of n <= MAX_WIDTH tokens where measured cheaper: `measure`
times one-row forwards of every width 1 .. MAX_WIDTH (the fastest of `passes` each: noise only
adds time), `plan` finds the cheapest split of each n into such widths (a split only where it
saves SPLIT_MARGIN or more: a split costs a call and a logits copy the timings barely see), and
LlamaRunner.set_widths applies it. The cost is a property of the machine, the model file and
the threads, so nothing here encodes a machine's figures: each machine measures its own, once,
and the result is cached under the key its caller gives (build.py: machine, model, threads,
versions). Wider forwards (prefills) keep one call per batch_tokens: their cost per token only
falls from there.
"""

import hashlib
import json
import os
import random
import time
from pathlib import Path

MAX_WIDTH = 16  # widths measured and planned: a batch of 8 rows with a draft each
SPLIT_MARGIN = 0.05  # a split must save at least this share of the one call's time
PASSES = 2
CONTEXT_TOKENS = 64  # the timing row's context: a verification is a few tokens on a context
KEY = "forward-widths"  # the timing row's key in the runner (released afterwards)


def measure(runner, max_width: int = MAX_WIDTH, passes: int = PASSES) -> list[float]:
    """Seconds of one forward of w tokens on one row, w = 1 .. max_width (index w - 1), the fastest
    of `passes` passes over all widths (a drift of the machine reaches every width alike)."""
    rng = random.Random(0)
    vocab = runner.vocab_size
    context = [rng.randrange(vocab) for _ in range(CONTEXT_TOKENS)]
    best = [float("inf")] * max_width
    try:
        runner.feed([KEY], [context], tail=[1])  # untimed: the context, and the kernels warmed
        for _ in range(passes):
            for w in range(1, max_width + 1):
                extra = [rng.randrange(vocab) for _ in range(w)]
                t0 = time.perf_counter()
                runner.feed([KEY], [context + extra], tail=[w])  # rolls the last pass's extra back
                best[w - 1] = min(best[w - 1], time.perf_counter() - t0)
    finally:
        runner.release([KEY])
    return best


def plan(seconds: list[float], margin: float = SPLIT_MARGIN) -> list[tuple[int, ...]]:
    """The calls' widths for a forward of n tokens, n = 1 .. len(seconds) (index n - 1): the
    cheapest sum of measured widths, kept only where it beats one call by `margin`."""
    best, split = [0.0], [()]  # best[n]: the cheapest time of n tokens; split[n]: its widths
    for n in range(1, len(seconds) + 1):
        w = min(range(1, n + 1), key=lambda w: (seconds[w - 1] + best[n - w], len(split[n - w])))  # ties: fewer calls
        cost = seconds[w - 1] + best[n - w]
        if cost < (1 - margin) * seconds[n - 1]:
            best.append(cost)
            split.append(tuple(sorted((w, *split[n - w]), reverse=True)))
        else:
            best.append(seconds[n - 1])
            split.append((n,))
    return split[1:]


def cached_plan(runner, key: dict, cache: Path, progress=print) -> list[tuple[int, ...]]:
    """The plan of this key from the cache, else measured on `runner` and written there."""
    path = cache / f"{_hash(key)}.json"
    try:
        entry = json.loads(path.read_text())
        widths = [tuple(int(w) for w in x) for x in entry["plan"]]
        if entry["key"] == json.loads(json.dumps(key, default=str)) and valid(widths):
            return widths
    except (OSError, ValueError, KeyError, TypeError):
        pass
    progress(f"llama.cpp: timing forwards of 1-{MAX_WIDTH} tokens (once per machine and model) ...")
    seconds = measure(runner)
    widths = plan(seconds)
    splits = {n + 1: w for n, w in enumerate(widths) if len(w) > 1}
    progress(f"llama.cpp: forwards split where cheaper: {splits or 'none'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "seconds": seconds, "plan": widths}, indent=1, default=str))
    os.replace(tmp, path)  # several processes may measure at once: the last one wins
    return widths


def valid(widths: list[tuple[int, ...]]) -> bool:
    """A plan of every width 1 .. MAX_WIDTH whose calls add up to it (a cache entry read back)."""
    return len(widths) == MAX_WIDTH and all(sum(p) == n and min(p) >= 1 for n, p in enumerate(widths, 1))


def _hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
