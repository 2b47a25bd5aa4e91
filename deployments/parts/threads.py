"""A serving process's CPU share: torch threads from the CPUs Ray gives it (Ray sets
OMP_NUM_THREADS=1 in an actor with fractional CPUs, which leaves a replica that owns most of a
core's share on one thread), its priority over the rest of the node, and the one thread that runs
its torch work."""

import asyncio
import logging
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("fly_serve.threads")
T = TypeVar("T")


def threads_from_ray() -> int | None:
    """The CPUs assigned to this actor (its bundle's share included), rounded up; None outside Ray."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    except Exception:  # not in a Ray worker
        return None
    return max(1, math.ceil(cpus)) if cpus else None


def serve_at_priority(nice: int | None) -> int | None:
    """Lower this process's nice to `nice` (every thread it has now, so every thread it starts
    later inherits it), and return the nice it runs at; None leaves it. Why: a 2-thread torch
    forward stalls at every barrier when any other process preempts one of its threads, and on a
    CPU node the Ray control plane (controller, raylet, GCS, proxy) and whatever else runs there
    wake up all the time. Measured on 2 cores with other load (docs/journal.md, "Serving
    processes first"). Below the current nice needs root or CAP_SYS_NICE: without it the process
    stays where it is, with a warning (above it, anyone may)."""
    if nice is None:
        return None
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == current:
        return current
    for tid in os.listdir("/proc/self/task"):  # Linux: nice is per thread
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except PermissionError as e:
            log.warning("serving_nice %d not applied (%s); running at nice %d", nice, e, current)
            return current
    return nice


# ---- one torch thread per process
# Why: torch's CPU kernels run on OpenMP (libgomp), and every thread that starts a parallel region
# gets a team of its own. Once a process holds more OpenMP threads than it has CPUs, libgomp stops
# spinning at its barriers (it waits about a hundred spins instead of ~300,000, then sleeps on a
# futex), so every one of a forward's hundreds of parallel regions pays a wake-up. A replica that
# loaded its model on Serve's init thread and ran each call on whichever `asyncio.to_thread` worker
# was free held several teams, and a second idle team slowed plain decoding (docs/journal.md,
# "One OpenMP team"). So a serving process loads, verifies, drafts and probes on one thread; the ingress's is
# its engine loop (engine_loop.py).
_local = threading.local()
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _mark_torch_thread() -> None:
    _local.torch = True


def torch_executor() -> ThreadPoolExecutor:
    """This process's torch thread (started on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="fly-torch", initializer=_mark_torch_thread)
        return _executor


def on_torch_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on this process's torch thread, waiting for it (inline when already there)."""
    if getattr(_local, "torch", False):
        return fn(*args)
    return torch_executor().submit(fn, *args).result()


async def on_torch_thread_async(fn: Callable[..., T], *args) -> T:
    """on_torch_thread for a coroutine: awaits without blocking the event loop."""
    return await asyncio.wrap_future(torch_executor().submit(fn, *args))
