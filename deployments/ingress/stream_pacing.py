"""A generation's updates merged into fewer deliveries, on the engine thread: a stream's text at
most once every `interval_s`, an answer sent whole only when it is done.

Every delivery wakes the replica's event loop (`call_soon_threadsafe`), which then takes the GIL
from the engine thread, and every chunk a stream sends costs Serve and its proxy work of their
own (a Ray object a chunk). Where those processes share the cores that compute the tokens (a CPU
target) that work is taken from the forward: on a 2-core VM a stream of one chunk a token took
1.04-1.09x the time of the same request unstreamed (docs/journal.md, "Streamed chunks paced"),
and the engine thread waited on the GIL ~1.6 times a token while the loop woke every round
("The event loop woken only for a chunk"). So the engine thread holds the text itself and wakes
the loop only for what goes out.

The first text goes out at once (the time to first token is not paced), and so does the last
update (finish reason, usage, or the request's failure). In between, text is held until a round
ends interval_s or more after the last delivery: held text waits at most interval_s plus one round.
A failure is delivered after the text held before it, as it would be unpaced.
"""

import dataclasses
import math
import time
from collections.abc import Callable

from .engine_loop import Update

WHOLE = math.inf  # the interval of an answer sent whole: only its last update is delivered


def merged(held: Update | None, new: Update) -> Update:
    """new, carrying the text held before it (its other fields are the later ones)."""
    return new if held is None else dataclasses.replace(new, text=held.text + new.text)


class Pacer:
    """One request's sink (engine_loop.EngineLoop.submit's): called on the engine thread with each
    round's update, passes them to `deliver` merged, at most one every interval_s (0: each one;
    WHOLE: the last only)."""

    def __init__(
        self, deliver: Callable[[Update], None], interval_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.deliver, self.interval_s, self.clock = deliver, interval_s, clock
        self.held: Update | None = None
        self.sent_at: float | None = None  # when text last went out; None: no text yet

    def __call__(self, update: Update) -> None:
        if update.finish_reason is not None and update.error and self.held is not None and self.held.text:
            self._send(self.held)  # the text made before the failure first, as unpaced
            self.held = None
        held = self.held = merged(self.held, update)
        if held.finish_reason is not None or self._due(held):
            self.held = None
            self._send(held)

    def _due(self, held: Update) -> bool:
        if not held.text or self.interval_s == WHOLE:
            return False
        if self.sent_at is None:
            return True  # the first text
        return self.clock() - self.sent_at >= self.interval_s

    def _send(self, update: Update) -> None:
        if update.text:
            self.sent_at = self.clock()
        self.deliver(update)
