"""The device check (scripts/gpu_check.py) on the CPU with tiny shapes, as a GPU host runs it: the
script itself, end to end (every method at every batch for both pairs, Hugging Face's generate as
the peer, the bandwidth), one JSON, exit 0; the fixed-shape draft loop as a GPU would take it."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"ar", "spd_k1", "spd_k2", "spd_k4", "spd_k8", "spd_k16", "fly_k_auto", "pld"}


def test_the_device_check_runs_on_the_cpu_with_tiny_shapes(tmp_path):
    cmd = [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--small", "--reps", "1"]
    cmd += ["--e2e-tokens", "8", "--draft-loop", "fixed", "--deadline-s", "3000"]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["failed"] == [] and result["errors"] == {}
    e2e = result["end_to_end"]
    assert e2e["bandwidth_gb_s"] > 0
    for pair in ("qwen2.5-1.5b/0.5b", "llama-3-8b/1b"):
        runs = e2e[pair]
        assert runs["draft_loop"] == "fixed" and runs["bandwidth_tok_s_batch1"] > 0
        for batch in ("b1", "b8", "b16"):
            got = runs[batch]
            assert METHODS <= set(got) and all(got[m]["complete"] for m in METHODS), got
            assert got["spd_k16"]["drafted"] > 0 and got["ar"]["x_ar"] == 1.0
            assert got["hf_generate_tok_s"] > 0
            assert max(got["host_reads_a_round"].values()) <= 3  # the fixed loop's budget
        assert runs["b1"]["hf_assisted_tok_s"] > 0
    assert "draft_step_x_graph" not in e2e["qwen2.5-1.5b/0.5b"]["b1"]["spd_k16"]  # graphs: cuda only
    assert all(isinstance(result[f"costs.{m}"], dict) for m in ("qwen2.5-1.5b", "qwen2.5-0.5b", "llama-3-8b-rope3.1"))
