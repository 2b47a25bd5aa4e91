"""A server given the machine alone: every process of another one on the same machine stopped
(SIGSTOP) for a block, continued (SIGCONT) after. On 2 cores an idle `fly-serve serve` (Ray's
actors, agents, GCS, raylet, their timers) takes cores from a neighbour's kernels: 2.4-5.2% of
llama-server's speed on the development VM (docs/journal.md, "The idle service's tax on the
cores"); a user who compares two servers runs one at a time. Pauses of 40 s left the service
answering at once after (checked by hand, 2026-12-07): its timers stop and resume with it."""

import contextlib
import os
import signal
import time

import psutil


def tree_pids(root: int) -> list[int]:
    """The root and every process under it."""
    proc = psutil.Process(root)
    return [root, *(p.pid for p in proc.children(recursive=True))]


def listener_root(port: int) -> int:
    """The root process of the server listening on this machine's `port`: from the listening
    process up, the topmost ancestor that is not this process or one of its ancestors (a shell
    both were started from) and not the leader of a session: a server started from another
    terminal stops below that terminal's shell, so nothing else that runs there is stopped with it.
    For `fly-serve serve` that is the launcher, above Ray's head processes and its workers (started
    as a session's leader, `setsid fly-serve serve`: its child above the listener, Ray's raylet, and
    what runs under it). Raises LookupError when nothing listens there."""
    listeners = {
        c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    listeners.discard(None)  # another user's socket: no pid to see
    if not listeners:
        raise LookupError(f"no process of this machine (visible to this user) listens on port {port}")
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    proc = psutil.Process(min(listeners))
    while (
        (parent := proc.parent()) is not None
        and parent.pid not in mine
        and parent.pid != 1
        and not _leads_a_session(parent.pid)
    ):
        proc = parent
    if proc.pid in mine:
        raise LookupError(f"port {port} is this process's own")
    return proc.pid


def listener_tree(port: int) -> list[int]:
    """The processes of the server listening on `port`: its root (listener_root) and everything
    under it."""
    return tree_pids(listener_root(port))


@contextlib.contextmanager
def paused(pids: list[int], settle_s: float = 2.0):
    """Every process stopped until the block ends, then continued (those that are gone skipped).
    The block starts once each one is seen stopped (a signal lands when the process is next
    scheduled), or after settle_s."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + settle_s
    for pid in pids:
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.001)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _leads_a_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except ProcessLookupError:
        return False


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
