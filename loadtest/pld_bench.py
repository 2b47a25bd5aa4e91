"""Per-round cost of prompt lookup for `pld` mode: in-process (in the ingress, the default) vs a
call to the PLD deployment.   python loadtest/pld_bench.py [--batch 8] [--tokens 600]"""

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rows_for(batch, n_tokens, k):
    from fly_serve.contracts import Row

    rng = random.Random(0)
    # code-like text repeats n-grams, so lookups find matches (the realistic, costlier case)
    vocab = [rng.randrange(150_000) for _ in range(200)]
    return [Row(f"r{b}", [rng.choice(vocab) for _ in range(n_tokens)], k=k) for b in range(batch)]


def timed(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "p90_ms": round(sorted(times)[int(n * 0.9)] * 1e3, 3),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--n", type=int, default=200)
    a = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = str(ROOT)
    import ray
    from ray import serve

    from deployments.lookup_replica import LookupDeployment
    from fly_serve.drafters import LookupDrafter

    rows = rows_for(a.batch, a.tokens, a.k)
    local = LookupDrafter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    handle = serve.run(LookupDeployment.bind(), name="pld", route_prefix=None)
    handle.propose.remote(rows).result()  # warm-up
    out = {
        "batch": a.batch,
        "tokens": a.tokens,
        "k": a.k,
        "in_process": timed(lambda: local.propose(rows), a.n),
        "deployment": timed(lambda: handle.propose.remote(rows).result(), a.n),
    }
    serve.shutdown()
    ray.shutdown()
    print(out)


if __name__ == "__main__":
    main()
