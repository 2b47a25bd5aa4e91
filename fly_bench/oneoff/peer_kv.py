"""llama-server with N slots, its KV cache as `--parallel N` gives it (one stream a slot) and as
one pool for all slots (`--kv-unified`, fly-serve's runtime's layout), taking turns: N chats of
ours at once, greedy, each prompt fresh, aggregate tokens a second of one burst after a warm one.

    python -m fly_bench.oneoff.peer_kv --slots 8 --repeats 2
"""

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from fly_bench.llama_server import LlamaServer
from fly_bench.prompts import TASKS
from fly_serve.loading.weights import DEFAULT_TARGET, gguf_file

KINDS = ["code", "rewrite", "math", "multilingual", "prose", "c", "code", "math"]


def burst(url: str, n: int, max_tokens: int) -> float:
    """Tokens a second of n chats sent at once (each its own nonce: no cache holds it)."""
    nonce = random.randrange(10**9)

    def one(i: int) -> int:
        prompt = f"(#{nonce}-{i}) {TASKS[KINDS[i % len(KINDS)]]}"
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        r = requests.post(f"{url}/v1/chat/completions", json=body | {"temperature": 0, "ignore_eos": True}, timeout=900)
        return r.json()["usage"]["completion_tokens"]

    t = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        tokens = sum(ex.map(one, range(n)))
    return tokens / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args()
    model = gguf_file(DEFAULT_TARGET)
    layouts = {"per slot (--parallel's own)": {}, "unified (--kv-unified)": {"kv-unified": True}}
    seen = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, flags in layouts.items():
            with LlamaServer(model, slots=args.slots, context=4096, flags=flags) as server:
                burst(server.url, args.slots, args.max_tokens)  # warm
                seen[name].append(burst(server.url, args.slots, args.max_tokens))
            print(f"{name}: {', '.join(f'{x:.2f}' for x in seen[name])} tok/s", flush=True)


if __name__ == "__main__":
    main()
