"""Torch threads of a replica from the CPUs Ray gives it: Ray sets OMP_NUM_THREADS=1 in an actor
with fractional CPUs, which leaves a replica that owns most of a core's share on one thread."""

import math


def threads_from_ray() -> int | None:
    """The CPUs assigned to this actor (its bundle's share included), rounded up; None outside Ray."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    except Exception:  # not in a Ray worker
        return None
    return max(1, math.ceil(cpus)) if cpus else None
