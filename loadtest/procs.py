"""The app's processes, found one way: the process tree under a root pid (a `fly-serve serve`
child, or the test process that runs Ray itself), Ray workers named by their title ("ray::<actor>",
a Serve replica "ray::ServeReplica:<app>:<deployment>"). A SIGKILL that reaches only processes
this process started, and the resident memory of a set of processes."""

import os
import signal
import urllib.parse

import psutil

SERVER_MARKS = ("fly-serve", "fly_cli", "deployments.launch", "serve run")  # in a server's command line


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4, ppid (the name may hold spaces)
        chain.append(pid)
    return chain


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_ours(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process this process started, directly or through its Ray (never anything else)."""
    if pid == os.getpid() or os.getpid() not in ancestors(pid):  # a guard that python -O keeps
        raise PermissionError(f"pid {pid} is not a process this run started")
    os.kill(pid, sig)


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:  # the process is gone already
        return []


def app_processes(root_pid: int) -> dict[int, str]:
    """pid -> name of root_pid and its Ray processes (actor workers are titled "ray::<class>")."""
    out = {root_pid: "server"}
    for pid in descendants(root_pid):
        try:
            title = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::"):
            out[pid] = title.split()[0].removeprefix("ray::").split(".")[0]
    return out


def replica_pids(root_pid: int, actor: str) -> list[int]:
    """Live Ray workers under root_pid whose actor class is `actor` ("TPWorker") or that are a Serve
    replica of the deployment `actor` ("FlyDrafter"), oldest pid first."""
    names = app_processes(root_pid)
    return sorted(pid for pid, name in names.items() if (name == actor or name.endswith(f":{actor}")) and alive(pid))


def server_pid_for(url: str) -> int | None:
    """The server process: the nearest ancestor of the process listening on the URL's port (Serve's
    HTTP proxy, a Ray worker) whose command line is a `fly-serve serve` / `serve run`."""
    port = urllib.parse.urlparse(url).port or 80
    listeners = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid]
    if not listeners:
        return None
    for p in psutil.Process(listeners[0]).parents():
        if any(mark in " ".join(p.cmdline()) for mark in SERVER_MARKS):
            return p.pid
    return None


def rss_mib(pids: dict[int, str]) -> dict[str, float]:
    """Resident memory of each process (MiB), keyed "name (pid)"; a gone process is left out."""
    out = {}
    for pid, name in sorted(pids.items(), key=lambda kv: kv[1]):
        try:
            out[f"{name} ({pid})"] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            pass
    return out
