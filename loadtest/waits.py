"""Waiting on a live app: one loop (`until`) that every wait goes through, so each has a
deadline and a poll interval and none hangs; and a background watch of a value (/healthz's status,
a count of replicas) that records when it changed."""

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


class Watch:
    """Calls read() every poll_s in the background from t0 (default: its start) and records each
    change of the value and when it came, so a run can say when a status flipped or a count grew."""

    def __init__(self, read: Callable[[], object], poll_s: float, t0: float | None = None):
        self.read, self.poll_s = read, poll_s
        self.t0 = time.monotonic() if t0 is None else t0
        self.changes: list[tuple[float, object]] = []  # (seconds since t0, value)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            value = self.read()
            if not self.changes or self.changes[-1][1] != value:
                self.changes.append((time.monotonic() - self.t0, value))
            self.stop.wait(self.poll_s)

    def first(self, value: object, after_s: float = 0.0) -> float | None:
        """Seconds from t0 until the value was first `value` (at or after after_s)."""
        return next((round(t, 1) for t, v in self.changes if v == value and t >= after_s), None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class HealthWatch(Watch):
    """/healthz's status (None: no answer) every 0.2 s: when it went 503 and when it came back."""

    def __init__(self, url: str, poll_s: float = 0.2):
        super().__init__(lambda: healthz(url, timeout_s=2.0), poll_s)
