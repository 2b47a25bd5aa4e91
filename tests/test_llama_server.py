"""llama.cpp's llama-server as the benchmarks' peer (fly_bench/llama_server.py), on real processes:
the server started on a tiny GGUF file, its greedy answers equal to fly-serve's llama.cpp runtime
on the same file, its figures, its stop; `fly-serve bench` with it and an engine on a second
runtime; the load sweep's peer (a subprocess: Locust patches the process for gevent). Where no
llama-server is built (scripts/build_llama_server.sh) these skip, saying so."""

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from fly_bench import run
from fly_bench.llama_server import LlamaServer, LlamaServerMissing, find_binary
from fly_bench.methods import parse_method
from fly_serve.loading.loading import gguf_path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 42, 99, 3, 8], [1, 2, 3, 4, 5, 6, 7, 30, 31]]


@pytest.fixture(scope="module")
def binary():
    try:
        return find_binary()
    except LlamaServerMissing as e:
        pytest.skip(f"no llama-server here (build it: scripts/build_llama_server.sh): {e}")


@pytest.fixture(scope="module")
def server(binary):
    with LlamaServer(gguf_path("tiny:0"), slots=2, context=512, threads=1, binary=binary) as s:
        yield s


def test_a_missing_binary_names_the_build_script(monkeypatch, tmp_path):
    monkeypatch.setenv("FLY_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(LlamaServerMissing, match="FLY_LLAMA_SERVER=.*nowhere: not an executable"):
        find_binary()
    monkeypatch.delenv("FLY_LLAMA_SERVER")
    monkeypatch.setenv("FLY_SERVE_CACHE", str(tmp_path))  # no build there
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LlamaServerMissing, match="scripts/build_llama_server.sh"):
        find_binary()


def test_greedy_answers_are_the_runtimes_own_tokens_with_the_servers_figures(server):
    from fly_serve.build import build_engine

    engine = build_engine("tiny:0", None, runtime="llama.cpp", max_model_len=512)
    want = [r.generated for r in engine.generate(PROMPTS, {"mode": "ar", "max_tokens": 12})]
    alone = [server.complete(p, 12) for p in PROMPTS]
    assert [a.token_ids for a in alone] == want  # the same file, the same kernels, the same tokens
    for a in alone:
        assert a.finish_reason == "length" and a.text
        assert 0 < a.ttft_s <= a.wall_s
        assert a.timings["predicted_n"] == 12 and a.timings["prompt_n"] >= 1 and a.timings["predicted_per_second"] > 0
    together, makespan = server.complete_many(PROMPTS, [dict(max_tokens=12)] * 2)
    assert [a.token_ids for a in together] == want and makespan >= max(a.wall_s for a in together)


def test_a_stop_string_ends_the_answer_before_it(server):
    text = server.complete(PROMPTS[0], 12).text
    stop = text[2:4]
    got = server.complete(PROMPTS[0], 12, stop=[stop])
    assert got.finish_reason == "stop" and stop not in got.text and text.startswith(got.text)


def test_a_bad_flag_fails_the_start_with_the_servers_words_and_exit_leaves_no_child(binary):
    bad = LlamaServer(gguf_path("tiny:0"), threads=1, flags={"no-such-flag": 1}, binary=binary)
    with pytest.raises(RuntimeError, match="exited .* while starting"):
        bad.start()
    assert bad.proc.poll() is not None
    with LlamaServer(gguf_path("tiny:0"), threads=1, context=256, binary=binary) as s:
        assert s.complete(PROMPTS[0], 2).token_ids
    assert s.proc.poll() is not None  # stopped on exit: only its own child


def test_llama_server_methods_parse_and_refuse_what_the_bench_sets():
    m = parse_method("llama-server-draft:spec-draft-n-max=16")
    assert (m.kind, m.options, m.batch_sizes_allowed) == (
        "llama-server",
        {"spec-type": "draft-simple", "spec-draft-n-max": 16},
        None,
    )
    assert parse_method("llama-server-ngram").options == {"spec-type": "ngram-simple"}
    assert parse_method("ar@torch").runtime == "torch" and parse_method("ar@torch").base == "ar"
    assert parse_method("fly@llama.cpp:k=6").options == {"k": 6} and parse_method("fly").runtime is None


@pytest.mark.parametrize(
    "spec, why",
    [
        ("llama-server:threads=4", "threads is set by the bench"),
        ("llama-server@torch", "a peer has its own runtime"),
        ("hf-greedy@llama.cpp", "a peer has its own runtime"),
        ("ar@gpu", "unknown runtime"),
    ],
)
def test_a_bad_peer_or_runtime_is_refused_naming_it(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_method(spec)


def test_bench_runs_llama_server_beside_engines_on_two_runtimes(binary, tmp_path):
    from test_bench import SAMPLE, bench_args

    methods = ["ar", "ar@torch", "llama-server"]
    args = bench_args(tmp_path, "--methods", *methods, "--runtime", "llama.cpp", "--batch-sizes", "1", "2")
    problems = {"gsm": SAMPLE["gsm"]}  # t/2 has a stop string
    rows = {(r.batch, r.method): r for r in run.run(args, problems=problems)}
    assert set(rows) == {(b, m) for b in (1, 2) for m in methods}
    for b in (1, 2):
        assert rows[(b, "ar")].runtime == "llama.cpp" and rows[(b, "ar@torch")].runtime == "torch"
        peer = rows[(b, "llama-server")]
        assert peer.runtime == "llama-server" and peer.vs_peer == 1.0 and peer.tokens > 0
        assert peer.identical == peer.compared == 3  # greedy on the same file: ar's tokens on llama.cpp
        assert rows[(b, "ar")].vs_peer == pytest.approx(rows[(b, "ar")].tok_s / peer.tok_s)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    served = [r for r in records if r["method"] == "llama-server"]
    assert len(served) == 6 and all(r["timings"]["predicted_n"] > 0 and r["ttft_s"] > 0 for r in served)
    assert all("e" not in r["text"] for r in records if r["problem"] == "t/2")  # the stop string held
    summary = json.loads((tmp_path / "summary.json").read_text())
    notes = " ".join(summary["notes"])
    assert "runtime llama.cpp: ar" in notes and "runtime torch: ar@torch" in notes and "--parallel 2" in notes
    assert "| llama-server | llama-server |" in (tmp_path / "summary.md").read_text()


def test_load_sweep_peer_on_the_tiny_gguf(binary, tmp_path):
    """The peers alone (no fly-serve app): one and two users, bursts, through llama-server's
    OpenAI-compatible chat endpoint; the table's ratios are against the first peer."""
    args = ["--methods", "--peer", "llama-server", "llama-server-draft", "--peer-target", "tiny:0"]
    args += ["--peer-drafter", "tiny:1", "--peer-threads", "1", "--peer-context", "256"]
    args += ["--users", "1", "2", "--together", "1", "--max-tokens", "6", "--out", str(tmp_path)]
    args += ["--prompts", "code", "multilingual"]  # TASKS by name: user j of a burst sends prompt j
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.load_sweep", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for users in ("1", "2"):
        for peer in ("llama-server", "llama-server-draft"):
            s = summary[users][peer]
            assert s["requests"] == int(users) and s["failures"] == 0 and s["tokens"] > 0, s
            assert 0 < s["p50_ttft_s"] <= s["p50_latency_s"]
    assert (
        "--parallel 2" in summary["peers"]["llama-server"]
        and "--spec-draft-model" in summary["peers"]["llama-server-draft"]
    )
    table = (tmp_path / "summary.md").read_text()
    assert "| x llama-server | x llama-server (bursts) | TTFT x llama-server |" in table
    assert "| 2 | llama-server | " in table and "| - | - | 1.00 | 1.00 | 1.00 |" in table
    draft = summary["2"]["llama-server-draft"]["tokens_per_s"] / summary["2"]["llama-server"]["tokens_per_s"]
    assert (
        f"| 2 | llama-server-draft | {summary['2']['llama-server-draft']['tokens_per_s']:.2f} | - | - | {draft:.2f} |"
        in (table)
    )
    by_prompt = summary["by_prompt"]  # 1 user: code only; 2 users: one request of each
    assert list(by_prompt["1"]) == ["code"] and sorted(by_prompt["2"]) == ["code", "multilingual"]
    for users, prompt in (("1", "code"), ("2", "code"), ("2", "multilingual")):
        rates = by_prompt[users][prompt]
        assert set(rates) == {"llama-server", "llama-server-draft"} and min(rates.values()) > 0
        ratio = rates["llama-server-draft"] / rates["llama-server"]
        assert (
            f"| {users} | {prompt} | llama-server-draft | {rates['llama-server-draft']:.2f} | - | {ratio:.2f} |"
            in table
        )
        # the decoding apart from the prefill: ms a token after the first, and the peer's over it
        after = summary["decode_by_prompt"][users][prompt]
        assert set(after) == set(rates) and min(after.values()) > 0
        over = after["llama-server"] / after["llama-server-draft"]
        assert f"{ratio:.2f} | {after['llama-server-draft']:.1f} | {over:.2f} |" in table


SERVICE = (  # a stand-in service: listens on a port it prints, and a child that notes the time every 5 ms
    "import socket, subprocess, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    'tick = \'import sys, time\\nwith open(sys.argv[1], "a") as f:\\n    while True:\\n'
    '        f.write(f"{time.perf_counter()}\\\\n"); f.flush(); time.sleep(0.005)\\n\'\n'
    "subprocess.Popen([sys.executable, '-c', tick, sys.argv[1]])\n"
    "print(s.getsockname()[1], flush=True)\n"
    "time.sleep(600)\n"
)


def test_load_sweep_peer_alone_stops_the_service_while_the_peer_runs(binary, tmp_path):
    """--peer-alone: every process of the server on --host's port is stopped for each of the peer's
    runs (its warm-up and bursts) and runs again after: no tick of its child inside a peer's
    request, ticks between them."""
    ticks = tmp_path / "ticks"
    service = subprocess.Popen([sys.executable, "-c", SERVICE, str(ticks)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(service.stdout.readline())
        args = ["--methods", "--peer", "llama-server", "--peer-target", "tiny:0", "--peer-threads", "1"]
        args += ["--peer-context", "256", "--users", "1", "--together", "2", "--max-tokens", "6", "--prompts", "code"]
        args += ["--host", f"http://127.0.0.1:{port}", "--peer-alone", "--fresh", "--out", str(tmp_path / "out")]
        done = subprocess.run(
            [sys.executable, "-m", "loadtest.load_sweep", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        for p in psutil.Process(service.pid).children(recursive=True):
            p.kill()
        service.kill()
        service.wait()
        service.stdout.close()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["peers_alone"] == {"service_paused_times": 3}  # the warm-up and 2 bursts
    at = [float(line) for line in ticks.read_text().split()]
    with open(tmp_path / "out" / "llama-server-u1.csv") as f:
        rows = list(csv.DictReader(f))
    requests = [(float(r["start"]), float(r["start"]) + float(r["latency_s"])) for r in rows]
    assert len(requests) == 2
    # --fresh: each request's prompt had a number of its own before it
    assert len({r["prefix"] for r in rows}) == 2 and all(re.fullmatch(r"\(#\d+\) ", r["prefix"]) for r in rows)
    for start, end in requests:
        assert not [t for t in at if start <= t <= end], (start, end)
    between = [t for t in at if requests[0][1] < t < requests[1][0]]
    assert between, "the service ran between the peer's bursts"


def test_load_sweep_peer_alone_without_a_service_is_refused(binary, tmp_path):
    args = ["--methods", "--peer", "llama-server", "--peer-target", "tiny:0", "--host", "http://127.0.0.1:9"]
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.load_sweep", *args, "--peer-alone", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--peer-alone: the service at http://127.0.0.1:9" in done.stderr, done.stderr
