"""What GatherIO.read (a batch's whole KV copied out of the paged pool, per layer, per forward)
costs next to the rest of a decode step, on a tiny-depth model at a real layer shape.

    python -m fly_bench.oneoff.gather_cost [--layers 2] [--context 2000] [--batch 8]

One decode step (T = 1) of `batch` rows of `context` cached tokens each, rows' blocks interleaved
(so the forward must gather), Qwen2.5-1.5B's layer shape (hidden 1536, 12 heads, 2 KV heads of
128, MLP 8960) at `--layers` layers, fp32 on this CPU. Prints the step's time and the time of the
gathers alone (both K and V, every layer), best of a few. Nothing is asserted.
"""

import argparse
import time

import torch

from fly_serve.runner import GatherIO, Runner
from fly_serve.tiny import tiny_model

QWEN_1_5B_LAYER = dict(
    hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=1024
)


def best_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    model = tiny_model(0, num_hidden_layers=a.layers, max_position_embeddings=8192, **QWEN_1_5B_LAYER)
    runner = Runner(model, n_slots=a.batch, budget_tokens=a.batch * (a.context + 64))
    keys = [f"r{b}" for b in range(a.batch)]
    tokens = [[(b * 7 + t) % 1000 for t in range(a.context)] for b in range(a.batch)]
    for n in range(16, a.context + 1, 16):  # grow the rows together: their blocks interleave
        runner.feed(keys, [t[:n] for t in tokens], logits=False)
    step = [t + [1] for t in tokens]

    def decode():
        runner.cache.release([])  # nothing; the step below rewrites the same position each time
        runner.feed(keys, step, logits=True)

    cache = runner.cache
    seqs = [cache.seq_of[k] for k in keys]
    n_keys = a.context + 1
    n_blocks = -(-n_keys // cache.block_size)
    table = cache.block_table(seqs, n_blocks)
    pos = torch.full((a.batch, 1), a.context)
    io = GatherIO(table, pos, cache.block_size, n_keys)

    def gathers():
        for i in range(a.layers):
            io.read(cache.k[i]), io.read(cache.v[i])

    step_ms, gather_ms = best_ms(decode), best_ms(gathers)
    kv_mb = 2 * a.layers * a.batch * n_keys * 2 * 128 * 4 / 1e6
    print(
        f"batch {a.batch}, context {a.context}, {a.layers} layers (fp32): decode step {step_ms:.1f} ms, "
        f"gathers {gather_ms:.1f} ms ({100 * gather_ms / step_ms:.0f}%), {kv_mb:.0f} MB copied per step"
    )


if __name__ == "__main__":
    main()
