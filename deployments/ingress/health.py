"""Whether the parts behind the ingress are sound, from one prober thread.

Health means the service, not a request: a round whose rows failed may have failed for their
own reasons (a poison request alone in the batch), so a failed round only makes the prober ask
each part (`healthy()` on the target and the drafter pool). Only a part that fails its probe
makes the ingress unhealthy, until it answers again. The same loop, at start, waits until every
part has answered once (their constructors, the weights, are done): until then, "loading".
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from deployments.parts.remote_parts import wait

log = logging.getLogger("ray.serve")

PROBE_TIMEOUT_S = 30.0  # one probe of a part (at start it may still be loading)
PROBE_RETRY_S = 1.0


@dataclass(frozen=True)
class Part:
    name: str  # "target", "drafter pool"
    probe: Callable[[], object]  # starts the part's health call; returns its Serve response


class Prober:
    def __init__(
        self,
        parts: list[Part],
        timeout_s: float = PROBE_TIMEOUT_S,
        retry_s: float = PROBE_RETRY_S,
        on_ready: Callable[[], None] | None = None,
    ):
        """on_ready: runs on this thread once every part has answered, before `ready` is set (the
        ingress calibrates k auto's cost profile there)."""
        self.parts, self.timeout_s, self.retry_s, self.on_ready = parts, timeout_s, retry_s, on_ready
        self.ready = threading.Event()  # every part has answered once
        self.broken: str | None = None  # the part that failed its last probe, and why
        self.checking = threading.Event()  # a probe after a failed round is under way
        self._suspect = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fly-prober", daemon=True)
        self.thread.start()

    def round_failed(self, reason: str) -> None:
        """From the engine thread after a failed round: probe the parts (never blocks)."""
        log.info("fly: a round failed (%s); probing the parts", reason)
        self.checking.set()
        self._suspect.set()

    def stop(self) -> None:
        self._stop.set()
        self._suspect.set()

    def _run(self) -> None:
        self._until_every_part_answers(at_start=True)
        if self._stop.is_set():
            return
        if self.on_ready is not None:
            self.on_ready()
        self.ready.set()
        log.info("fly: ready, every part answers")
        while True:
            self._suspect.wait()
            if self._stop.is_set():
                return
            self._suspect.clear()
            self._until_every_part_answers(at_start=False)
            self.checking.clear()

    def _until_every_part_answers(self, at_start: bool) -> None:
        for part in self.parts:
            while not self._stop.is_set():
                try:
                    wait(part.probe(), self.timeout_s, f"{part.name} (health)")
                    break
                except Exception as e:
                    if not at_start:
                        self.broken = f"the {part.name} failed its health probe; retry shortly"
                        self.checking.clear()  # the verdict is in: unhealthy
                    log.info("fly: the %s is not answering yet (%s)", part.name, type(e).__name__)
                    self._stop.wait(self.retry_s)
        if self.broken and not self._stop.is_set():
            log.info("fly: every part answers again")
            self.broken = None
