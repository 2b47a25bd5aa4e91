"""Server-sent events of one streamed generation (OpenAI's wire format)."""

import json
from collections.abc import AsyncIterator, Callable

from deployments.http.openai_api import ResponseBodies

from .engine_loop import Update


def sse(body) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def events(
    updates: AsyncIterator[Update],
    bodies: ResponseBodies,
    include_usage: bool,
    error_body: Callable[[BaseException], dict],
) -> AsyncIterator[str]:
    """A role chunk (chat), a chunk per update with text, the usage (on the last chunk, or in a
    chunk of its own with include_usage), then [DONE]. Headers are sent by then, so a failure is
    the stream's last event before [DONE]: `error_body(e)` says what the client is told."""
    try:
        if bodies.chat:
            yield sse(bodies.chunk(None, role=True))
        last = None
        async for u in updates:
            last = u
            done = u.finish_reason is not None
            if u.text or done:
                chunk = bodies.chunk(u.text, u.finish_reason)
                if done and not include_usage:
                    chunk |= {"usage": bodies.usage(u), "fly": u.fly}
                yield sse(chunk)
        if include_usage and last is not None:
            yield sse(bodies.usage_chunk(last))
    except Exception as e:
        yield sse(error_body(e))
    yield sse("[DONE]")
