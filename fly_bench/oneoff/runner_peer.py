"""The llama.cpp runtime's runner alone against llama-server, runs taking turns: the prefill of a
chat prompt and a plain decode after it (feed + argmax, no engine around it), with variants of the
runner's context. What the kernels cost when they are driven as fly-serve drives them, without
the engine's round (fly_bench.oneoff.token_time measures that).

    python -m fly_bench.oneoff.runner_peer --prompt rewrite --tokens 48 --repeats 5

Variants (--variants, JSON): `runner`'s keyword arguments by name, e.g.
'{"ours": {}, "8 ids": {"seqs": 8}, "8 donors": {"donors": 8}}' (seqs: llama.cpp's sequence ids
capped, as before issue 54; donors: released rows kept as the prefix cache keeps them, in host memory
since they left the KV cache; fly_bench.oneoff.idle_cells measures cells held in it).
Both sides compute the whole prompt every run (no prompt cache)."""

import argparse
import json
import statistics
import time

from fly_bench.llama_server import LlamaServer
from fly_bench.prompts import TASKS
from fly_serve.engine.prompts import chat_prompt
from fly_serve.loading.loading import load_tokenizer
from fly_serve.loading.weights import DEFAULT_TARGET, gguf_file
from fly_serve.runtime import llama_runner


def runner(
    model,
    seqs: int | None = None,
    slots: int = 8,
    batch: int = 512,
    donors: int = 0,
    donor_tokens: int = 300,
    drafter: bool = False,
):
    """A LlamaRunner as the engine makes one; donors: that many released rows of donor_tokens kept
    first (the prefix cache's donors, as earlier requests leave them); drafter:
    the embedded draft model loaded beside it in its own context, run once (as the engine holds it)."""
    lib = llama_runner.lib()
    real = lib.llama_max_parallel_sequences
    if seqs:
        lib.llama_max_parallel_sequences = lambda: seqs
    try:
        r = llama_runner.LlamaRunner(model, n_slots=slots, threads=2, batch_tokens=batch, prefix_cache=donors > 0)
    finally:
        lib.llama_max_parallel_sequences = real
    if drafter:
        from fly_serve.loading.weights import DEFAULT_DRAFTER

        d_model = llama_runner.GGUFModel(str(gguf_file(DEFAULT_DRAFTER, print)))
        r.beside = llama_runner.LlamaRunner(d_model, n_slots=slots, threads=2, batch_tokens=batch)
        r.beside.feed(["once"], [[1000 + i for i in range(64)]], tail=[1])
    for d in range(donors):
        key = f"donor-{d}"
        r.feed([key], [[(1000 + 97 * d + i) % 150000 for i in range(donor_tokens)]], tail=[1])
        r.release([key])
    return r


def ours(r, key: str, ids: list[int], tokens: int) -> tuple[float, float]:
    """(prefill ms, ms per decoded token after the first)."""
    toks = list(ids)
    t0 = time.perf_counter()
    logits, _ = r.feed([key], [toks], tail=[1])
    toks.append(int(logits[0, -1].argmax()))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        logits, _ = r.feed([key], [toks], tail=[1])
        toks.append(int(logits[0, -1].argmax()))
    decode = (time.perf_counter() - t0) / (tokens - 1)
    r.release([key])
    return 1000 * prefill, 1000 * decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="rewrite", choices=sorted(TASKS))
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", default='{"ours": {}}')
    args = p.parse_args()
    ids = chat_prompt(load_tokenizer(DEFAULT_TARGET, print), TASKS[args.prompt])
    path = gguf_file(DEFAULT_TARGET, print)
    model = llama_runner.GGUFModel(str(path))
    variants = {name: runner(model, **kw) for name, kw in json.loads(args.variants).items()}
    res: dict[str, list[tuple[float, float]]] = {}
    with LlamaServer(path) as server:
        print(f"{len(ids)} prompt tokens; {server.command}", flush=True)
        server.complete(ids, 4)  # warm-up
        for name, r in variants.items():
            ours(r, f"warm-{name}", ids, 4)
        for i in range(args.repeats):
            c = server.complete(ids, args.tokens)
            decode = 1000 * (c.wall_s - c.ttft_s) / (len(c.token_ids) - 1)
            res.setdefault("llama-server", []).append((c.timings.get("prompt_ms"), decode))
            for name, r in variants.items():
                res.setdefault(name, []).append(ours(r, f"{name}-{i}", ids, args.tokens))
    for name, xs in res.items():
        prefill, decode = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        runs = [(round(a), round(b, 1)) for a, b in xs]
        print(f"{name:14s} prefill {prefill:8.1f} ms  decode {decode:6.2f} ms/token  runs {runs}")


if __name__ == "__main__":
    main()
