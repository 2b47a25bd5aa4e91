"""A draft model's GGUF file requantized to Q4_0 for llama.cpp's CPU kernels, once, into the cache.

A drafter only proposes: strict verification keeps the output the target's, so its weights may be
coarser than the file it ships as (the torch runtime's int8 drafter is the same choice). On a CPU a
drafter's forward is bound by the bytes it reads, and Q4_0 (4.5 bits a weight, every tensor
including the output head and the embeddings) is the lightest type llama.cpp's fastest CPU kernels
take. The embedded 0.5B drafter ships at 6.2 bits a weight (Q5_0 body, a Q8_0 head of 151,936
rows); requantized, its one-token forward took 0.72x the time and a 5-token one 0.59x, with the
same acceptance on our prompts (docs/journal.md, "The drafter at Q4_0"). The rule, not a
measurement of a machine: a file heavier than LIGHT_BITS is requantized, one as light runs as
shipped (a 4-bit k-quant, ~4.9 bits a weight, would gain little). The target is never
requantized: its outputs are the answer.

Coarser weights change a small drafter's choices more: Gemma 3 270M (its tied head and embeddings
are most of its weights) lost 7-20% of its acceptance at Q4_0 where the Qwen 0.5B lost none. So a
drafter's "auto" keeps the Q4_0 form only where it is faithful to the shipped file (`faithful`):
the two files' greedy tokens agree at >= AGREEMENT of the positions of a fixed text where the
shipped file is confident (a property of the files, not of the machine: checked once, kept beside
the Q4_0 file). Asked for by name (drafter_precision q4_0), the Q4_0 form runs regardless."""

import hashlib
import json
import os
import time
from pathlib import Path

from .weights import cache_dir, file_lock

Q4_0_BITS = 4.5  # 32 weights in 18 bytes
LIGHT_BITS = 5.0  # a file at most this heavy runs as shipped (Q4_0, Q4_K_M and lighter)
# faithful(): the share of confident positions (the shipped file's top probability >= CONFIDENT)
# whose greedy token the Q4_0 form keeps. On REFERENCE (2026-12-07): Qwen2.5-Coder 0.5B 0.95
# (its acceptance unchanged), Gemma 3 270M 0.71 (its acceptance 7-20% lower; docs/journal.md)
AGREEMENT, CONFIDENT = 0.88, 0.3
REFERENCE = """def merge_intervals(intervals):
    \"\"\"Merge overlapping intervals given as (start, end) pairs.\"\"\"
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


class LRUCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

A train leaves the station at 9:40 and travels 180 km at 72 km/h. How long does the trip take?
The time is distance divided by speed: 180 / 72 = 2.5 hours, so the train arrives at 12:10.
If it then waits 15 minutes and returns at 90 km/h, the return trip takes 2 hours.

The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined
movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books
became cheaper, literacy spread, and ideas travelled faster than ever before across Europe.

Ein Zug fährt um 9:40 Uhr ab und legt 180 km mit 72 km/h zurück. Die Fahrt dauert also zweieinhalb
Stunden, und der Zug kommt um 12:10 Uhr an. Danach wartet er eine Viertelstunde.
"""


def bits_per_weight(path: Path) -> float:
    """The file's weight bytes over its weights, in bits, as llama.cpp counts them (the file mapped,
    not repacked: a fraction of a second where reading the header in Python takes seconds)."""
    from fly_serve.runtime.llama_runner import GGUFModel, lib

    model = GGUFModel(str(path), repack=False)
    L = lib()
    return 8 * L.llama_model_size(model.ptr) / max(1, L.llama_model_n_params(model.ptr))


def q4_0_path(path: Path) -> Path:
    """Where the requantized form of `path` is kept: named by the file (path, size, mtime) and the
    llama.cpp that wrote it."""
    st = path.stat()
    from fly_serve.runtime.llama_runner import lib

    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|llama-cpp-python {lib().__version__}"
    return cache_dir() / "converted" / f"{path.stem}-q4_0-{hashlib.sha256(key.encode()).hexdigest()[:12]}.gguf"


def requantized(path: Path, progress=print) -> Path:
    """The GGUF file a drafter at precision q4_0 runs: `path` itself if it is at most LIGHT_BITS a
    weight already, else its Q4_0 form, written once (under a lock: replicas may start together) and renamed
    into place only when complete."""
    path = Path(path)
    out = q4_0_path(path)
    if out.is_file():
        return out
    bits = bits_per_weight(path)
    if bits <= LIGHT_BITS:
        return path
    with file_lock(out.with_name(f".{out.name}.lock")):
        if not out.is_file():
            start = time.monotonic()
            _quantize(path, out)
            progress(
                f"drafter: {path.name} ({bits:.1f} bits a weight) requantized to Q4_0 once, "
                f"{time.monotonic() - start:.0f} s: {out}"
            )
    return out


def _quantize(src: Path, out: Path) -> None:
    import ctypes

    from fly_serve.runtime.llama_runner import default_threads, lib

    L = lib()
    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
    # llama.cpp keeps the head and the embeddings heavier by default; a drafter's head is its
    # heaviest read (a row per token of the vocabulary)
    params.output_tensor_type = params.token_embedding_type = L.GGML_TYPE_Q4_0
    params.allow_requantize = True  # the shipped file is quantized already
    params.nthread = default_threads()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        if L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"drafter_precision q4_0: llama.cpp could not requantize {src}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def faithful(shipped: Path, light: Path, progress=print) -> bool:
    """Whether the Q4_0 form keeps the shipped file's confident greedy choices (module docstring),
    computed once (under a lock: replicas may start together) and kept beside it, for this
    reference text and confidence bound."""
    verdict = light.with_name(f"{light.stem}.agreement.json")
    asked = {"confident": CONFIDENT, "reference": hashlib.sha256(REFERENCE.encode()).hexdigest()[:12]}
    agreement = _read_verdict(verdict, asked)
    if agreement is None:
        with file_lock(verdict.with_name(f".{verdict.name}.lock")):
            agreement = _read_verdict(verdict, asked)
            if agreement is None:
                agreement = _agreement(shipped, light)
                tmp = verdict.with_name(f".{verdict.name}.tmp{os.getpid()}")
                tmp.write_text(json.dumps({"agreement": agreement, **asked}))
                os.replace(tmp, verdict)
    if agreement < AGREEMENT:
        progress(
            f"drafter: {shipped.name} runs as shipped: its Q4_0 form kept {agreement:.0%} of its confident "
            f"greedy choices (< {AGREEMENT:.0%}); drafter_precision q4_0 runs it anyway"
        )
    return agreement >= AGREEMENT


def _read_verdict(path: Path, asked: dict) -> float | None:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got.get("agreement") if all(got.get(k) == v for k, v in asked.items()) else None


def _agreement(shipped: Path, light: Path) -> float:
    import ctypes

    import torch

    from fly_serve.runtime.llama_runner import GGUFModel, LlamaRunner, lib

    L = lib()
    models = [GGUFModel(str(shipped)), GGUFModel(str(light))]
    text = REFERENCE.encode()
    buf = (ctypes.c_int32 * (len(text) + 16))()
    n = L.llama_tokenize(L.llama_model_get_vocab(models[0].ptr), text, len(text), buf, len(buf), True, False)
    ids = list(buf[: max(n, 0)])
    picks = []
    for model in models:  # [N] greedy tokens and confidences, 128 positions a forward (a 262k head)
        runner, top, conf = LlamaRunner(model, n_slots=1, budget_tokens=len(ids) + 8), [], []
        for end in range(128, len(ids) + 128, 128):
            logits, fed = runner.feed(["reference"], [ids[:end]])
            x = logits[0, : fed[0]].float()
            top.append(x.argmax(-1))
            conf.append(torch.exp(x.amax(-1) - torch.logsumexp(x, -1)))
        picks.append((torch.cat(top), torch.cat(conf)))
    (a, confidence), (b, _) = picks
    confident = confidence >= CONFIDENT
    return float((a == b)[confident].float().mean()) if confident.any() else 0.0
