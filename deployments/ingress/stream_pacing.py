"""A streamed generation's updates merged into fewer chunks: at most one every `interval_s`.

Every chunk a stream sends costs the service's processes work of their own: the replica's event
loop wakes, Serve hands the chunk to its proxy as a message of its own (a Ray object), the proxy
writes it out. Where those processes share the cores that compute the tokens (a CPU target) that
work is taken from the forward: on a 2-core VM a stream of one chunk a token took 1.04-1.09x the
time of the same request unstreamed (docs/journal.md, "Streamed chunks paced"). A chunk
every interval_s carries all the text made meanwhile, so the cost falls with the chunks while the
client still reads the text as it comes.

The first text goes out at once (the time to first token is not paced), and so does the last
update (finish reason, usage). In between, text is held until an update arrives interval_s or more
after the last chunk: held text waits at most interval_s plus one round. A failure raised by the
updates (the request's error answer) comes after the text held before it, as it would unpaced.
"""

import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from .engine_loop import Update


def merged(held: Update | None, new: Update) -> Update:
    """new, carrying the text held before it (its other fields are the later ones)."""
    return new if held is None else dataclasses.replace(new, text=held.text + new.text)


async def paced(
    updates: AsyncIterator[Update], interval_s: float, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[Update]:
    """updates, merged so that text goes out at most once every interval_s (0: every update)."""
    if interval_s <= 0:
        async for u in updates:
            yield u
        return
    held: Update | None = None
    sent_at: float | None = None  # when text last went out; None: no text yet
    try:
        async for u in updates:
            held = merged(held, u)
            now = clock()
            first = sent_at is None and bool(held.text)
            if held.finish_reason is not None or first or (sent_at is not None and now - sent_at >= interval_s):
                out, held = held, None
                sent_at = now if out.text else sent_at
                yield out
    except Exception:
        if held is not None and held.text:  # what the client would have had before the error
            yield held
        raise
    if held is not None:  # updates that ended without a finishing update (not the engine's way)
        yield held
