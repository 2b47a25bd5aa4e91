"""Scaling out (tiny models, real Ray and Serve, 127.0.0.1): the drafter pool grows under load
and every live drafter replica drafts its share of each round; two ingress + target units share
the pool, each ingress pinned to its own target; outputs equal the in-process engine's. Also the
load sweep's own mechanics (loadtest/load_sweep.py, in a subprocess: Locust patches the process
for gevent), and docs/serving.md's `locust -f loadtest/locustfile.py` run headless against the app."""

import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from serve_fixture import ROOT, per_replica, running, start_serve, stop_serve

from fly_serve.build import build_engine

pytestmark = pytest.mark.serve

APP = {
    "tiny": True,
    "units": 2,
    "max_batch": 4,
    "affinity_groups": 4,
    "defaults": {"max_tokens": 24},
    # scale out at the first sign of drafting: a tiny drafter is never busy for long
    "drafter_autoscaling": {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0.5,
        "downscale_delay_s": 600,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
        "policy": {"policy_function": "deployments.routing.replica_pool:BusyPolicy", "policy_kwargs": {"target": 0.01}},
    },
}
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "1, 2, 3, 4, 5,", "hello hello hello"]


@pytest.fixture(scope="module")
def url():
    base = start_serve(APP)
    yield base
    stop_serve()


@pytest.fixture(scope="module")
def reference():
    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024)
    return {p: engine.generate([p], [{"max_tokens": 24, "mode": "fly"}])[0].text for p in PROMPTS}


def complete(url, prompt):
    r = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wave(url, n=8):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: (PROMPTS[i % 4], complete(url, PROMPTS[i % 4])), range(n)))


def test_drafter_pool_scales_out_and_every_replica_drafts(url, reference):
    deadline = time.monotonic() + 240
    while running("FlyDrafter") < 2:
        assert time.monotonic() < deadline, "no second drafter replica within 240 s of load"
        for prompt, text in wave(url):
            assert text == reference[prompt]
    pids = per_replica("FlyDrafter", "pid", 2)
    assert len(set(pids)) == 2  # the groups are pinned to distinct replicas
    before = [r["rows"] for r in per_replica("FlyDrafter", "cache_report", 2)]
    # waves until both replicas drafted rows: each ingress splits its rows by its count of live
    # replicas, which a thread of its own refreshes (LiveReplicas' ttl) when a round asks
    deadline = time.monotonic() + 120
    while True:
        for prompt, text in wave(url):
            assert text == reference[prompt]  # outputs do not depend on which replica drafted
        after = [r["rows"] for r in per_replica("FlyDrafter", "cache_report", 2)]
        if all(a > b for a, b in zip(after, before)):
            break
        assert time.monotonic() < deadline, (before, after)


def test_two_units_each_with_its_own_target(url, reference):
    assert running("FlyIngress") == 2 and running("FlyTarget") == 2
    pids = [r.pid for r in per_replica("FlyTarget", "report", 2)]
    assert len(set(pids)) == 2
    before = [r.rows_verified for r in per_replica("FlyTarget", "report", 2)]
    for prompt, text in wave(url, 12):
        assert text == reference[prompt]
    after = [r.rows_verified for r in per_replica("FlyTarget", "report", 2)]
    assert all(a > b for a, b in zip(after, before)), (before, after)  # the proxy spread requests over both


def sweep(url: str, out: Path, *args: str) -> dict:
    """Run the load sweep against url into out; its summary.json."""
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.load_sweep", "--host", url, "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_load_sweep_mechanics(url, tmp_path):
    args = ["--users", "1", "2", "--methods", "ar", "fly:k=auto", "--duration", "3", "--max-tokens", "8"]
    summary = sweep(url, tmp_path, *args)
    for users in ("1", "2"):
        for method in ("ar", "fly:k=auto"):
            s = summary[users][method]
            assert s["requests"] >= 1 and s["failures"] == 0 and s["tokens"] > 0, s
            assert s["tokens_per_s"] > 0 and s["p50_ttft_s"] <= s["p50_latency_s"]
        assert summary[users]["ar"]["drafts_per_round"] == [0.0] * summary[users]["ar"]["requests"]
    assert (tmp_path / "ar-u1.csv").is_file() and "| 2 | fly:k=auto |" in (tmp_path / "summary.md").read_text()


def test_load_sweep_bursts_give_every_method_the_same_prompts_in_turns(url, tmp_path):
    summary = sweep(url, tmp_path, "--users", "3", "--methods", "ar", "fly:k=3", "--together", "2", "--max-tokens", "6")
    prompts, bursts = {}, {}
    for method, name in (("ar", "ar"), ("fly:k=3", "fly_k3")):
        s = summary["3"][method]
        assert s["requests"] == 6 and s["failures"] == 0 and s["tokens"] > 0, s  # 2 bursts of 3 users
        assert len(s["bursts_s"]) == 2 and sum(s["burst_tokens"]) == s["tokens"], s
        assert s["wall_s"] == pytest.approx(sum(s["bursts_s"]), abs=0.02)
        with open(tmp_path / f"{name}-u3.csv") as f:
            rows = list(csv.DictReader(f))
        prompts[method] = sorted(int(r["prompt"]) for r in rows)
        rows.sort(key=lambda r: float(r["start"]))
        # a burst's 3 requests start together
        starts = [float(r["start"]) for r in rows]
        assert starts[2] - starts[0] < 1.0 and starts[5] - starts[3] < 1.0, starts
        bursts[method] = [
            (starts[3 * n], max(float(r["start"]) + float(r["latency_s"]) for r in rows[3 * n : 3 * n + 3]))
            for n in (0, 1)
        ]
    assert prompts["ar"] == prompts["fly:k=3"] == [0, 1, 2, 3, 4, 5]
    # the methods take turns: ar's burst 0, k 3's bursts 0 and 1, ar's burst 1; each after the last has finished
    (ar0, ar1), (k0, k1) = bursts["ar"], bursts["fly:k=3"]
    assert ar0[1] <= k0[0] and k0[1] <= k1[0] and k1[1] <= ar1[0], bursts
    assert "| 3 | fly:k=3 |" in (tmp_path / "summary.md").read_text()


def test_load_sweep_puts_llama_server_beside_the_app(url, tmp_path):
    """The peer (llama-server on tiny:0's GGUF file) in the same bursts as the app's ar, the
    app's rows with their ratio against it (tests/test_llama_server.py: the peer's own mechanics)."""
    from fly_bench.llama_server import LlamaServerMissing, find_binary

    try:
        find_binary()
    except LlamaServerMissing as e:
        pytest.skip(f"no llama-server here (scripts/build_llama_server.sh): {e}")
    args = ["--users", "2", "--methods", "ar", "--peer", "llama-server", "--peer-target", "tiny:0"]
    summary = sweep(url, tmp_path, *args, "--peer-threads", "1", "--together", "1", "--max-tokens", "6")
    ar, peer = summary["2"]["ar"], summary["2"]["llama-server"]
    assert ar["requests"] == peer["requests"] == 2 and ar["failures"] == peer["failures"] == 0
    table = (tmp_path / "summary.md").read_text()
    ratio = ar["tokens_per_s"] / peer["tokens_per_s"]
    assert f"| 2 | ar | {ar['tokens_per_s']:.2f} | 1.00 | 1.00 | {ratio:.2f} |" in table


def test_the_readmes_locust_command_runs_from_the_repository_root(url, tmp_path):
    """`locust -f loadtest/locustfile.py --host <url>` as docs/serving.md shows it, headless and short:
    every request answered (Locust exits 1 on any failure), none failed."""
    locust = Path(sys.executable).with_name("locust")  # the console script beside this interpreter
    argv = [str(locust), "-f", "loadtest/locustfile.py", "--headless", "--host", url, "-u", "2", "-r", "2"]
    argv += ["--run-time", "5s", "--stop-timeout", "30", "--only-summary", "--csv", str(tmp_path / "run")]
    env = os.environ | {"FLY_MAX_TOKENS": "8", "FLY_MAX_REQUESTS": "3"}
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "run_stats.csv") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    completions, tokens = stats["/v1/completions [fly]"], stats["completion_tokens [fly]"]
    assert 1 <= int(completions["Request Count"]) <= 6 and int(completions["Failure Count"]) == 0, completions
    assert int(stats["Aggregated"]["Failure Count"]) == 0
    assert tokens["Request Count"] == completions["Request Count"] and float(tokens["Average Content Size"]) >= 1
