"""Waiting on a live app: one loop (`until`) that every wait goes through, so each has a
deadline and a poll interval and none hangs; and a background watch of /healthz."""

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .client import CLIENT_TIMEOUT_S, Outcome, complete, healthz, stats

T = TypeVar("T")


def until(check: Callable[[], T | None], timeout_s: float, poll_s: float = 0.5) -> T | None:
    """check() every poll_s until it returns something other than None (returned) or timeout_s
    has passed (None). A check that raises counts as not yet (the app may be restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except Exception:
            got = None
        if got is not None or time.monotonic() >= deadline:
            return got
        time.sleep(poll_s)


def wait_status(url: str, status: int, timeout_s: float) -> float | None:
    """When (time.monotonic()) /healthz first answers `status`; None if not within timeout_s."""
    return until(lambda: time.monotonic() if healthz(url) == status else None, timeout_s, poll_s=0.1)


def wait_idle(url: str, timeout_s: float, headers: dict | None = None) -> dict | None:
    """The ingress's stats once nothing runs, waits or is in flight; None if not within timeout_s."""

    def idle():
        s = stats(url, headers=headers)
        return s if (s["running"], s["waiting"], s["in_flight"]) == (0, 0, 0) else None

    return until(idle, timeout_s)


def wait_healthy(url: str, timeout_s: float) -> bool:
    """/healthz 200 and nothing in flight, each within timeout_s (between scenarios)."""
    return wait_status(url, 200, timeout_s) is not None and wait_idle(url, timeout_s) is not None


def wait_generating(url: str, n: int, timeout_s: float = 60.0, rounds: int = 3) -> None:
    """Until n requests are running in the engine and `rounds` rounds have passed since."""
    first: list[int] = []  # the round count when n first ran together

    def generating():
        s = stats(url)
        if s["running"] >= n:
            first[:] = first or [s["rounds"]]
            return True if s["rounds"] >= first[0] + rounds else None
        return None

    if until(generating, timeout_s, poll_s=0.1) is None:
        raise AssertionError(f"{n} requests never ran together within {timeout_s:g} s: {stats(url)}")


def probe_until(
    url: str,
    body: dict,
    done: Callable[[list[Outcome]], bool],
    timeout_s: float,
    client_timeout_s: float = CLIENT_TIMEOUT_S,
) -> list[Outcome]:
    """Short requests, one after another, until done(the requests so far) or timeout_s: a
    recovery as clients see it."""
    probes: list[Outcome] = []

    def probe():
        if done(probes):
            return True
        probes.append(complete(url, body, timeout_s=client_timeout_s))
        return True if done(probes) else None

    until(probe, timeout_s)
    return probes


class HealthWatch:
    """Polls /healthz in the background from its start: each change of status and when it came
    (None: no answer), so a run can say when /healthz went 503 and when it came back."""

    def __init__(self, url: str, poll_s: float = 0.2):
        self.url, self.poll_s = url, poll_s
        self.t0 = time.monotonic()
        self.changes: list[tuple[float, int | None]] = []  # (seconds since start, status)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            status = healthz(self.url, timeout_s=2.0)
            if not self.changes or self.changes[-1][1] != status:
                self.changes.append((time.monotonic() - self.t0, status))
            self.stop.wait(self.poll_s)

    def first(self, status: int | None, after_s: float = 0.0) -> float | None:
        """Seconds from the start until /healthz first answered `status` (at or after after_s)."""
        return next((round(t, 1) for t, s in self.changes if s == status and t >= after_s), None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
