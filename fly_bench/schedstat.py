"""The scheduler's view of a process's threads (Linux `/proc/<pid>/task/<tid>/schedstat`): the time
each thread ran on a core and the time it waited runnable for one. On 2 cores the kernels' two
threads hold both; every other thread that runs (Ray's, HTTP's, the machine's own) takes a core from
one of them, and the kernels' barrier makes the other wait too. The wait is what that costs the
forward, measured rather than inferred from other processes' CPU (fly_bench.oneoff.token_time).
Where the file is missing (another OS, a kernel without schedstats) every reading is empty."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThreadTimes:
    on_cpu_s: float  # ran on a core
    waited_s: float  # runnable, waiting for a core (preempted or not yet picked)


def thread_times(pid: int) -> dict[int, ThreadTimes]:
    """Every thread of the process, by thread id, so far (empty if unreadable)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            on_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # a thread that ended, or no schedstats here
        out[int(task.name)] = ThreadTimes(on_ns / 1e9, wait_ns / 1e9)
    return out


def busy_threads(before: dict[int, ThreadTimes], after: dict[int, ThreadTimes], wall_s: float) -> ThreadTimes:
    """The threads that ran at least half of wall_s between the two readings (the kernels' threads
    during a decode: they run or spin all along), their on-core and waiting times summed."""
    on = waited = 0.0
    for tid, b in after.items():
        a = before.get(tid, ThreadTimes(0.0, 0.0))
        if b.on_cpu_s - a.on_cpu_s >= wall_s / 2:
            on += b.on_cpu_s - a.on_cpu_s
            waited += b.waited_s - a.waited_s
    return ThreadTimes(on, waited)
