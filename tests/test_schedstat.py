"""fly_bench.schedstat on real processes (a spinning one is busy and its core time counted, a
sleeping one is not) and its sum of the busy threads."""

import subprocess
import sys
import time

from fly_bench.schedstat import ThreadTimes, busy_threads, thread_times


def _watch(code: str, seconds: float = 0.6) -> tuple[ThreadTimes, dict, float]:
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)  # started, importing done
        before = thread_times(proc.pid)
        t0 = time.perf_counter()
        time.sleep(seconds)
        after = thread_times(proc.pid)
        wall = time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()
    return busy_threads(before, after, wall), after, wall


def test_a_spinning_thread_is_busy_and_its_core_time_counted():
    busy, after, wall = _watch("while True: pass")
    assert len(after) == 1  # one thread, read by its id
    assert wall / 2 <= busy.on_cpu_s <= wall * 1.05


def test_a_sleeping_process_has_no_busy_thread():
    busy, after, _ = _watch("import time; time.sleep(30)")
    assert after  # its thread was read
    assert busy == ThreadTimes(0.0, 0.0)


def test_a_process_that_is_gone_reads_empty():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert thread_times(proc.pid) == {}


def test_busy_threads_sums_those_that_ran_half_the_wall_a_new_one_from_zero():
    before = {1: ThreadTimes(10.0, 1.0), 2: ThreadTimes(5.0, 0.5), 3: ThreadTimes(1.0, 0.0)}
    after = {
        1: ThreadTimes(10.75, 1.25),  # ran 0.75 of 1 s, waited 0.25
        2: ThreadTimes(5.25, 0.5),  # 0.25: not a kernel thread
        4: ThreadTimes(0.5, 0.125),  # started between the readings, ran half the wall
    }
    assert busy_threads(before, after, 1.0) == ThreadTimes(0.75 + 0.5, 0.25 + 0.125)
