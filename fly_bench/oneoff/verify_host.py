"""The host's own work in one verification of the real target: `ModelScorer.verify`'s time minus
the runner's `feed` (llama.cpp's forward), for round shapes [rows x drafts], strict rows and rows
whose gate reads the entropy. Medians of 10 verifications after 2 warm-ups.

    python -m fly_bench.oneoff.verify_host

To compare two versions of the engine, run it from each checkout in turn (the journal's "The
round's reads of the vocabulary" ran it at two commits taking turns, three times).
"""

import statistics
import time

from fly_bench.oneoff.served_vs_engine import engine_config_for
from fly_serve.build import build_engine
from fly_serve.contracts import Drafts, Row

SHAPES = [(1, 0, None), (1, 15, None), (8, 1, None), (1, 15, "topk"), (8, 1, "topk")]  # (rows, drafts, entropy)
CODE = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3


def main() -> None:
    c = engine_config_for("deployments/profiles/cpu-default.yaml", tiny=False)
    engine = build_engine(c.target, None, config=c)
    scorer, ctx = engine.scorer, engine.tokenizer.encode(CODE)
    feed, spent = scorer.runner.feed, [0.0]

    def timed_feed(*a, **k):
        t = time.perf_counter()
        out = feed(*a, **k)
        spent[0] += time.perf_counter() - t
        return out

    scorer.runner.feed = timed_feed
    for B, K, ent in SHAPES:
        rows = [Row(f"v{B}-{K}-{ent}-{b}", ctx[: 40 + b], K, entropy=ent) for b in range(B)]
        # every fourth draft a token the target will not predict: a few mismatches a round
        drafts = Drafts([[ctx[40 + b + i] if i % 4 else 7 for i in range(K)] for b in range(B)], [None] * B)
        host = []
        for rep in range(12):
            spent[0], t = 0.0, time.perf_counter()
            scorer.verify(rows, drafts)
            if rep >= 2:
                host.append((time.perf_counter() - t - spent[0]) * 1000)
        scorer.release([r.key for r in rows])
        print(f"{B} rows x {K} drafts{', entropy ' + ent if ent else ''}: {statistics.median(host):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
