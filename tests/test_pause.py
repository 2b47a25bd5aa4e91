"""fly_bench/pause.py on a real process tree: every process under the root is stopped inside the
block and running after it, also when the block raises; the server on a port found by its
listening socket, up to its topmost ancestor that is not this process's own."""

import subprocess
import sys
import time

import psutil
import pytest

from fly_bench.pause import listener_root, listener_tree, paused, tree_pids

LISTENER = (  # listens on a free port and prints it
    "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); time.sleep(60)"
)
TREE = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {LISTENER!r}])\ntime.sleep(60)\n"


@pytest.fixture
def tree():
    """(the root's pid, the port its child listens on)."""
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(root.stdout.readline())  # the child's, through the pipe it inherited
        yield root.pid, port
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()
        root.stdout.close()


def _states(pids):
    return [psutil.Process(pid).status() for pid in pids]


def test_every_process_of_the_tree_is_paused_in_the_block_and_runs_after(tree):
    root, _ = tree
    pids = tree_pids(root)
    assert len(pids) == 2 and pids[0] == root
    with paused(pids):
        assert _states(pids) == [psutil.STATUS_STOPPED] * 2
    assert psutil.STATUS_STOPPED not in _states(pids)


def test_a_block_that_raises_still_continues_them(tree):
    root, _ = tree
    pids = tree_pids(root)
    with pytest.raises(RuntimeError), paused(pids):
        raise RuntimeError("a failed run")
    assert psutil.STATUS_STOPPED not in _states(pids)


def test_the_server_on_a_port_is_the_listeners_tree_from_below_this_process(tree):
    """The child listens; its parent (the root) is this test's child: the tree starts there, not
    at this process (never stopped) nor at the listener (its parent would run on)."""
    root, port = tree
    assert listener_root(port) == root
    assert listener_tree(port) == tree_pids(root)


def test_the_tree_stops_below_the_shell_of_another_session():
    """A server started from another terminal: its launcher's parent is that terminal's shell, the
    leader of a session of its own. The tree is the launcher's; the shell (and what else runs in
    that terminal) is not stopped."""
    shell = subprocess.Popen(  # the other terminal's shell: a session leader, its child the launcher
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {TREE!r}])\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(shell.stdout.readline())
        [launcher] = psutil.Process(shell.pid).children()
        assert listener_root(port) == launcher.pid
        assert shell.pid not in listener_tree(port)
    finally:
        for p in psutil.Process(shell.pid).children(recursive=True):
            p.kill()
        shell.kill()
        shell.wait()
        shell.stdout.close()


def test_a_port_nobody_listens_on_is_a_lookup_error(tree):
    _, port = tree
    [child] = psutil.Process(tree[0]).children()
    child.kill()
    deadline = time.monotonic() + 30
    while child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:  # its parent reaps it never
        time.sleep(0.01)
    with pytest.raises(LookupError, match=f"port {port}"):
        listener_tree(port)
