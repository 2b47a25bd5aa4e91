"""The local cluster's own process handling (deployments/local_cluster.py), without a cluster: the
Redis it starts dies with the process that started it, and the child resolves nothing between fork
and exec (the parent runs threads; a library loaded there can deadlock the child)."""

import ctypes
import subprocess
import sys
import time

from deployments import local_cluster
from loadtest.procs import alive


def test_the_child_only_calls_what_the_parent_resolved(monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a library loaded between fork and exec")

    monkeypatch.setattr(ctypes, "CDLL", no_loading)
    child = subprocess.run(["true"], preexec_fn=local_cluster._die_with_parent, timeout=30)
    assert child.returncode == 0


def test_a_child_dies_with_the_process_that_started_it():
    """A parent that starts `sleep` as the cluster starts its Redis, prints its pid and dies
    (SIGKILL, no cleanup of its own): the sleep is killed with it."""
    script = (
        "import os, signal, subprocess\n"
        "from deployments.local_cluster import _die_with_parent\n"
        "p = subprocess.Popen(['sleep', '60'], preexec_fn=_die_with_parent)\n"
        "print(p.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, f"the child {pid} outlived its parent"
        time.sleep(0.05)
