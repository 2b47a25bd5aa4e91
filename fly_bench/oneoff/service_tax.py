"""What an idle `fly-serve serve` costs a neighbour on the same cores, and served plain decoding
against llama-server with the machine to itself (issue 51).

  python -m fly_bench.oneoff.service_tax --prompts code math --rounds 4 --out bench_out/service_tax

The load sweep runs its llama-server peer beside the service it compares it with (`fly-serve bench`
has none: its engines run in its own process), so the peer pays the idle service's wake-ups (Ray's
actors, agents, GCS, raylet) as ours does; a user who runs one server at a time gives llama-server
the machine alone. This starts the service (the profile,
`fly_bench.oneoff.served_vs_engine.serving`) and llama-server on the target's GGUF, then, prompt by
prompt, in turns: llama-server with the service **paused** (SIGSTOP to every process of it, SIGCONT
after the request: its timers stop with it, and a pause lasts one request), llama-server **beside**
the idle service, **served** `ar`, and served `ar` with Ray's **background** paused (every process
of the service but the ingress replica and the HTTP proxy, which the request needs: the controller,
GCS, raylet, agents, log monitor, the launcher). Each run: ms a token after the first, and the
kernels' threads' time on the cores and waiting for one, a token of the whole request
(fly_bench.schedstat). Ratios are pairwise within a round: the service's tax on llama-server (beside
over paused), served `ar` against llama-server alone (paused) and beside it (what the sweep
reports), and served `ar` with the background paused against llama-server alone: what the request's
own path (proxy, replica, engine) costs apart from Ray's other processes.
"""

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from pathlib import Path

import psutil

from fly_bench.oneoff.served_vs_engine import serving
from fly_bench.oneoff.token_time import fresh, peer_run, peer_server, role, served_run
from fly_bench.pause import listener_root, paused, tree_pids
from fly_bench.prompts import TASKS
from fly_bench.report import write_results

PLACES = ("paused", "beside", "served", "background paused")
REQUEST_PATH = ("ingress replica", "proxy")  # the roles a served request runs through


def background(root: int) -> list[int]:
    """The service's processes a served request does not run through (one that ended meanwhile:
    left out)."""
    out = []
    for pid in tree_pids(root):
        with contextlib.suppress(psutil.NoSuchProcess):
            if role(psutil.Process(pid)) not in REQUEST_PATH:
                out.append(pid)
    return out


def one_round(url: str, root: int, server, prompt: str, max_tokens: int, order: tuple[str, ...]) -> dict:
    out = {}
    for place in order:
        if place == "served":
            out[place] = served_run(url, root, fresh(TASKS[prompt]), {"mode": "ar"}, max_tokens)
        elif place == "background paused":
            with paused(background(root)):
                out[place] = served_run(url, root, fresh(TASKS[prompt]), {"mode": "ar"}, max_tokens)
            time.sleep(0.5)
        elif place == "paused":
            with paused(tree_pids(root)):
                out[place] = peer_run(server, prompt, max_tokens)
            time.sleep(0.5)  # the service's own catch-up after the pause, not in the next run
        else:
            out[place] = peer_run(server, prompt, max_tokens)
    return out


def measure(config: str, prompts: list[str], rounds: int, max_tokens: int, port: int) -> dict:
    runs = defaultdict(list)  # (prompt, place) -> runs
    with serving(config, port, tiny=False) as url, peer_server() as server:
        root = listener_root(port)
        for prompt in prompts:
            one_round(url, root, server, prompt, 8, PLACES)  # warm-up
            for i in range(rounds):
                order = PLACES if i % 2 == 0 else PLACES[::-1]
                for place, run in one_round(url, root, server, prompt, max_tokens, order).items():
                    runs[(prompt, place)].append(run)
        command = server.command
    return {"peer_command": command, "runs": {f"{p}/{place}": r for (p, place), r in runs.items()}}


def summary(result: dict, prompts: list[str]) -> str:
    keys = ("ms_per_token", "threads_on_cpu_ms_per_token", "threads_waited_ms_per_token")
    lines = ["| prompt | place | ms a token | kernels' threads on the cores, ms a token | waiting, ms a token |"]
    lines.append("|---|---|---|---|---|")
    ratios = []
    for prompt in prompts:
        runs = {place: result["runs"][f"{prompt}/{place}"] for place in PLACES}
        for place, got in runs.items():
            cells = [statistics.median(r[k] for r in got) if all(k in r for r in got) else None for k in keys]
            lines.append(f"| {prompt} | {place} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")

        ratios.append(
            f"- {prompt}: the idle service's tax on llama-server (beside / paused, ms) "
            f"{_pairwise(runs['beside'], runs['paused']):.3f}; served `ar` x llama-server alone "
            f"{_pairwise(runs['paused'], runs['served']):.3f}, x llama-server beside it "
            f"{_pairwise(runs['beside'], runs['served']):.3f}; with Ray's background paused x llama-server alone "
            f"{_pairwise(runs['paused'], runs['background paused']):.3f} (pairwise medians of {len(runs['served'])})"
        )
    title = "# The idle service's tax, and served `ar` against llama-server alone"
    return "\n".join([title, "", *lines, "", *ratios, ""])


def _pairwise(num: list[dict], den: list[dict]) -> float:
    """The median of a round's ms a token over the other's, round by round."""
    return statistics.median(a["ms_per_token"] / b["ms_per_token"] for a, b in zip(num, den))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="deployments/profiles/cpu-default.yaml")
    p.add_argument("--prompts", nargs="+", default=["code", "math"], choices=sorted(TASKS))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out", default="bench_out/service_tax")
    args = p.parse_args()
    result = measure(args.config, args.prompts, args.rounds, args.max_tokens, args.port)
    write_results(Path(args.out), result, summary(result, args.prompts))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
