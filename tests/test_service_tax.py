"""fly_bench.oneoff.service_tax's pause, on a real process tree: every process under the root is
stopped inside the block and running after it, also when the block raises."""

import subprocess
import sys
import time

import psutil
import pytest

from fly_bench.oneoff.service_tax import paused, service_pids

TREE = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def tree():
    root = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(root.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield root.pid
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()


def _states(pids):
    return [psutil.Process(pid).status() for pid in pids]


def test_every_process_of_the_tree_is_paused_in_the_block_and_runs_after(tree):
    pids = service_pids(tree)
    assert len(pids) == 2 and pids[0] == tree
    with paused(pids):
        assert _states(pids) == [psutil.STATUS_STOPPED] * 2
    assert psutil.STATUS_STOPPED not in _states(pids)


def test_a_block_that_raises_still_continues_them(tree):
    pids = service_pids(tree)
    with pytest.raises(RuntimeError), paused(pids):
        raise RuntimeError("a failed run")
    assert psutil.STATUS_STOPPED not in _states(pids)
