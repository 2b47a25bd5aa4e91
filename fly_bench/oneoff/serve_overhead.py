"""Serve overhead and throughput on the real default pair (or --tiny).

  python -m fly_bench.oneoff.serve_overhead --max-tokens 48      # both phases, prints a JSON summary
  python -m fly_bench.oneoff.serve_overhead --phase serve --config deployments/cpu-default.yaml

Phase "inprocess": one request at a time through fly_serve.build.build_engine (no Ray).
Phase "serve": the same single request through the Serve app (latency -> overhead ratio), then
1, 4 and 8 concurrent requests (distinct prompts) for each mode: tokens/s = all completion
tokens / wall time of the wave. The phases run one after the other so they never share cores.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fly_bench.prompts import COMPLETIONS as PROMPTS
from fly_bench.timing import timed_one

ROOT = Path(__file__).resolve().parents[2]


def in_process(args) -> dict:
    from fly_serve.build import build_engine

    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024) if args.tiny else build_engine()
    out = {}
    for mode in args.modes:
        timed_one(engine, PROMPTS[0], max_tokens=8, mode=mode)  # warm-up
        t = timed_one(engine, PROMPTS[0], max_tokens=args.max_tokens, mode=mode)
        out[mode] = {
            "latency_s": round(t.wall_s, 3),
            "tokens": t.tokens,
            "tau": round(t.tau, 2),
            "tokens_per_s": round(t.tok_s, 2),
        }
    return out


def post(url, prompt, mode, max_tokens):
    import requests

    r = requests.post(
        f"{url}/v1/completions", timeout=1800, json={"prompt": prompt, "max_tokens": max_tokens, "fly": {"mode": mode}}
    )
    r.raise_for_status()
    return r.json()


def wave(url, n, mode, max_tokens) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda p: post(url, p, mode, max_tokens), prompts))
    dt = time.perf_counter() - t
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {
        "wall_s": round(dt, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / dt, 2),
        "max_batch": max(o["fly"]["max_batch_size"] for o in outs),
        "tau": round(sum(o["fly"]["tau"] for o in outs) / n, 2),
    }


def through_serve(args) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "deployments.launch", "--config", args.config, "--port", str(args.port)]
    server = subprocess.Popen(cmd + (["--tiny"] if args.tiny else []), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        for line in server.stdout:  # the launcher prints "ready" once /healthz answers
            if "ready at" in line:
                break
        out = {}
        for mode in args.modes:
            post(url, PROMPTS[0], mode, 8)  # warm-up
            t = time.perf_counter()
            o = post(url, PROMPTS[0], mode, args.max_tokens)
            dt = time.perf_counter() - t
            out[mode] = {
                "single": {
                    "latency_s": round(dt, 3),
                    "tokens": o["usage"]["completion_tokens"],
                    "tau": o["fly"]["tau"],
                },
                "waves": {n: wave(url, n, mode, args.max_tokens) for n in args.users},
            }
        return out
    finally:
        server.send_signal(2)  # SIGINT: the launcher shuts Serve and Ray down
        server.wait(timeout=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["inprocess", "serve", "both"], default="both")
    p.add_argument("--config", default=str(ROOT / "deployments" / "cpu-default.yaml"))
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--modes", nargs="+", default=["fly", "ar"])
    p.add_argument("--users", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    result = {"max_tokens": args.max_tokens, "config": args.config}
    if args.phase in ("inprocess", "both"):
        # a child process, so that its threads and memory are gone before Serve starts
        cmd = [
            sys.executable,
            "-m",
            "fly_bench.oneoff.serve_overhead",
            "--phase",
            "inprocess",
            "--max-tokens",
            str(args.max_tokens),
            "--modes",
            *args.modes,
        ] + (["--tiny"] if args.tiny else [])
        if args.phase == "both":
            out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
            result["inprocess"] = json.loads(out.strip().splitlines()[-1])["inprocess"]
        else:
            result["inprocess"] = in_process(args)
    if args.phase in ("serve", "both"):
        result["serve"] = through_serve(args)
    if "inprocess" in result and "serve" in result:
        result["overhead_ratio"] = {
            m: round(result["serve"][m]["single"]["latency_s"] / result["inprocess"][m]["latency_s"], 3)
            for m in args.modes
        }
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main()
