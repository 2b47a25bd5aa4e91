"""A serving process's CPU share: torch threads from the CPUs Ray gives it (Ray sets
OMP_NUM_THREADS=1 in an actor with fractional CPUs, which leaves a replica that owns most of a
core's share on one thread), and its priority over the rest of the node."""

import logging
import math
import os

log = logging.getLogger("fly_serve.threads")


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
    wake up all the time. Measured on 2 cores with other load (docs/BENCHMARKS.md, "Serving
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
