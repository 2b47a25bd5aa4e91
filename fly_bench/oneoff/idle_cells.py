"""What cells that no query reads cost a decoding row in llama.cpp's unified KV cache: two contexts
of the target's GGUF in one process, one holding idle rows of random tokens beside the row it
decodes (as released rows were kept as prefix-cache donors before they moved to host memory), the
other only its row; blocks of 8 greedy tokens taking turns, so the machine's drift falls on both.

    python -m fly_bench.oneoff.idle_cells --rows 8 --tokens 1000 --blocks 10

Every query of a forward scans every cell up to the highest one used (its flash attention reads
the mask of each before it skips it), so what it costs grows with the cells held, not with the
rows decoding. Prints ms per token with and without, and the per-block ratio's quartiles.
"""

import argparse
import random
import statistics
import time

from fly_bench.prompts import TASKS
from fly_serve.engine.prompts import chat_prompt
from fly_serve.loading.loading import load_tokenizer
from fly_serve.loading.weights import DEFAULT_TARGET, gguf_file
from fly_serve.runtime import llama_runner


def decode_block(r, toks: list[int], n: int = 8) -> float:
    """Seconds per token of n greedy steps of the row "row", its tokens extended in place."""
    t0 = time.perf_counter()
    for _ in range(n):
        logits, _ = r.feed(["row"], [toks], tail=[1])
        toks.append(int(logits[0, -1].argmax()))
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="idle rows held beside the decoding one")
    p.add_argument("--tokens", type=int, default=1000, help="tokens each idle row holds")
    p.add_argument("--blocks", type=int, default=10, help="blocks of 8 tokens each side")
    p.add_argument("--prompt", default="code", choices=sorted(TASKS))
    args = p.parse_args()
    model = llama_runner.GGUFModel(str(gguf_file(DEFAULT_TARGET, print)))
    tokenizer = load_tokenizer(DEFAULT_TARGET, print)
    sides = {name: llama_runner.LlamaRunner(model, n_slots=8, threads=2) for name in ("with", "without")}
    rows = {name: chat_prompt(tokenizer, TASKS[args.prompt]) for name in sides}
    for name, r in sides.items():  # the row first: its cells sit below the idle rows'
        logits, _ = r.feed(["row"], [rows[name]], tail=[1])
        rows[name].append(int(logits[0, -1].argmax()))
    rng = random.Random(0)
    for i in range(args.rows):
        sides["with"].feed([f"idle{i}"], [[rng.randrange(model.n_vocab) for _ in range(args.tokens)]], logits=False)
    times = {name: [] for name in sides}
    for b in range(args.blocks):
        for name in ("with", "without") if b % 2 == 0 else ("without", "with"):
            times[name].append(decode_block(sides[name], rows[name]))
    ratios = [a / b for a, b in zip(times["with"], times["without"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(
        f"{args.rows} idle rows x {args.tokens} tokens: with {1000 * statistics.median(times['with']):.2f} ms a "
        f"token, without {1000 * statistics.median(times['without']):.2f}; per-block ratio median "
        f"{statistics.median(ratios):.3f} (quartiles {q1:.3f}, {q3:.3f}), {args.blocks} blocks a side"
    )


if __name__ == "__main__":
    main()
