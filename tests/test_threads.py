"""A thread that runs forwards computes with the process's torch threads, not OMP_NUM_THREADS.

Ray sets OMP_NUM_THREADS=1 in a fractional-CPU actor, and OpenMP keeps its thread count per
thread: the serving loop and asyncio.to_thread's workers started at 1 however many threads the
replica set (loading.own_threads). Checked in a child process, where the variable is set before
torch loads OpenMP."""

import glob
import os
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import ctypes, glob, threading, torch
from fly_serve.build import build_engine
from fly_serve.loading import own_threads, set_threads
gomp = ctypes.CDLL(glob.glob(torch.__path__[0] + "/lib/libgomp*.so*")[0])
engine = build_engine("tiny:0", "tiny:1", max_model_len=256)
set_threads(2)
seen = []
def matmul():
    a = torch.randn(64, 64, dtype=torch.bfloat16)
    a @ a  # oneDNN: never asks torch for its thread count
    seen.append(gomp.omp_get_max_threads())
    own_threads()
    seen.append(gomp.omp_get_max_threads())
def serve():
    engine.generate([[1, 2, 3, 4]], {"mode": "spd", "k": 3, "max_tokens": 4})
    seen.append(gomp.omp_get_max_threads())
for fn in (matmul, serve):
    t = threading.Thread(target=fn)
    t.start()
    t.join()
print(*seen)
"""


@pytest.mark.skipif(not glob.glob(torch.__path__[0] + "/lib/libgomp*.so*"), reason="torch without its own libgomp")
def test_a_serving_thread_gets_the_process_threads_under_omp_num_threads_1():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    after_matmul, after_own, after_serving = map(int, out.stdout.split()[-3:])
    assert after_matmul == 1  # what a new thread computes with here, however many set_threads set
    assert after_own == 2
    assert after_serving == 2  # the engine's forwards (runner.forward) call own_threads
