"""The HTTP proxy's guard: request bodies are read whole in Serve's HTTP proxy, before Serve hands
the request to a replica, and headers Serve's proxy cannot read are refused there.

Why in the proxy. Serve routes a request to a replica as soon as its headers arrive, and the
replica then pulls the body from the proxy; every request counts against the replica's
`max_ongoing_requests` from that moment. A client that sends headers and dribbles its body
therefore holds one of those places until the body deadline, and past that limit every request,
/healthz included, waits in the proxy's queue behind it (issue 54: 120 such sockets stalled the
app for 40 s). Here the body is read by the proxy's event loop, where a waiting socket costs a
coroutine and nothing else; the replica only ever sees whole bodies, so its places are held by
requests it is working on. This is what a buffering front proxy (nginx's request buffering) does
for any upstream.

Every read is bounded: at most `max_body_bytes` (413, from Content-Length before reading, else
while reading), all of it within `body_timeout_s` (408), and at most `max_reads` bodies read at
once per proxy: past that, the read that has waited longest for its next bytes is cut (408) to
make room, so a socket that stalls gives way to one that sends. Memory: max_reads x
max_body_bytes at most. A client that leaves meanwhile is simply gone (nothing reached Serve).

Headers. Serve's proxy decodes X-Request-Id (and its session and multiplexing headers) as UTF-8
and answers a plain-text 500 that it does not log when they are not (issue 54). The guard refuses
such a request with a 400 naming the header, in OpenAI's error body, and logs it.

Serve loads this through its proxy hook: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names
`middlewares` here, read by each proxy process at its start, so it must be in the environment of
every node's Ray (`environment()`; launch.prepare_environment and the test fixture set it before
Ray starts; cluster.yaml exports it on every node). Each request the guard passed carries
`MARK`, so the ingress can tell when it runs behind a proxy without the guard.
"""

import asyncio
import logging
import os
import time

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse

from .openai_api import error_body
from .request_ids import Ids, new_id

log = logging.getLogger("ray.serve")  # the proxy's own log file

PROXY_HOOK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HOOK = "deployments.http.proxy_guard.middlewares"
MAX_BODY_BYTES_ENV = "FLY_PROXY_MAX_BODY_BYTES"
BODY_TIMEOUT_ENV = "FLY_PROXY_BODY_TIMEOUT_S"
MAX_READS_ENV = "FLY_PROXY_MAX_BODY_READS"
# Where the environment names the hook but not the bounds (environment() sets them all): the
# app's own defaults (deployments/profiles/app_args.py), which launch.proxy_bounds passes on.
FALLBACK_MAX_BODY_BYTES = 4 * 2**20
FALLBACK_BODY_TIMEOUT_S = 20.0
# Bodies read at once per proxy: far above what honest clients keep in flight (a body of a few KB
# arrives with its headers), and a bound on the proxy's memory (x max_body_bytes).
DEFAULT_MAX_READS = 64
MARK = b"x-fly-proxy-guard"  # set on every request the guard passed on (a client's own is dropped)
# Headers Serve's proxy decodes as UTF-8 (ray/serve/_private/proxy.py), by name with "-" read as
# "_" as it compares them: the request id, the multiplexed model id, the session id (its default
# name, or the one RAY_SERVE_SESSION_ID_HEADER_KEY gives).
DECODED_HEADERS = frozenset(
    {"x_request_id", "serve_multiplexed_model_id", os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")}
)

_DECODED = frozenset(name.lower().replace("-", "_") for name in DECODED_HEADERS)


def environment(max_body_bytes: int, body_timeout_s: float, max_reads: int = DEFAULT_MAX_READS) -> dict[str, str]:
    """The variables that install the guard in every Serve HTTP proxy that a Ray started with
    them runs, with its bounds (a profile's max_body_bytes and body_timeout_s)."""
    return {
        PROXY_HOOK_ENV: HOOK,
        MAX_BODY_BYTES_ENV: str(int(max_body_bytes)),
        BODY_TIMEOUT_ENV: f"{float(body_timeout_s):g}",
        MAX_READS_ENV: str(int(max_reads)),
    }


def middlewares() -> list[Middleware]:
    """Serve's proxy hook: the guard, with the bounds of this process's environment."""
    env = os.environ
    guard = Middleware(
        ProxyGuard,
        max_body_bytes=int(env.get(MAX_BODY_BYTES_ENV, FALLBACK_MAX_BODY_BYTES)),
        body_timeout_s=float(env.get(BODY_TIMEOUT_ENV, FALLBACK_BODY_TIMEOUT_S)),
        max_reads=int(env.get(MAX_READS_ENV, DEFAULT_MAX_READS)),
    )
    log.info("fly: proxy guard on (%s)", guard.kwargs)
    return [guard]


class Refused(Exception):
    """An answer the guard gives instead of passing the request on."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, close: bool = True):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.close = status, message, code, param, close


class Gone(Exception):
    """The client left while its body was read."""


class Reader:
    """One body being read: when it last received bytes, and whether it was cut to make room."""

    def __init__(self):
        self.last = time.monotonic()
        self.cut = asyncio.Event()


class Reads:
    """The bodies being read at once, at most `limit`: a new one past that cuts the read that
    has waited longest for its next bytes."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.readers: set[Reader] = set()
        self.cut = 0  # reads cut to make room, since start

    def join(self) -> Reader:
        live = [r for r in self.readers if not r.cut.is_set()]
        if len(live) >= self.limit:
            stalest = min(live, key=lambda r: r.last)
            stalest.cut.set()
            self.cut += 1
        reader = Reader()
        self.readers.add(reader)
        return reader

    def leave(self, reader: Reader) -> None:
        self.readers.discard(reader)


class ProxyGuard:
    """Pure ASGI middleware, outermost in Serve's proxy (module docstring)."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float, max_reads: int):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.reads = Reads(max_reads)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = new_id("proxy")  # the client's X-Request-Id, once it is known to be text (Serve's id too)
        try:
            self._check_headers(scope)
            rid = Ids.of(Headers(scope=scope).get("x-request-id"), "proxy").client_id
            body = await self._read_body(scope, receive)
        except Refused as e:
            where = f"{scope['method']} {scope['path']}"
            # a client's error, and a flood of slow bodies is many: info, as the replicas log 4xx
            level = logging.WARNING if e.code == "invalid_header" else logging.INFO
            log.log(level, "fly: %s refused in the proxy (%s, %d): %s", where, rid, e.status, e)
            return await self._answer(e, rid, scope, receive, send)
        except Gone:
            log.info("fly: %s %s: the client left before its body was read (%s)", scope["method"], scope["path"], rid)
            return None
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != MARK] + [(MARK, b"1")]
        await self.app({**scope, "headers": headers}, _replay(body, receive), send)

    @staticmethod
    def _check_headers(scope) -> None:
        for key, value in scope["headers"]:
            if key.decode("latin-1").lower().replace("-", "_") in _DECODED:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    name = key.decode("latin-1")
                    raise Refused(400, f"{name}: not valid UTF-8", "invalid_header", name, close=False) from None

    async def _read_body(self, scope, receive) -> bytes:
        """The whole body within the bounds (module docstring); Refused or Gone otherwise."""
        limit = self.max_body_bytes
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise Refused(413, f"body: larger than the limit of {limit} bytes", "request_too_large")
        reader = self.reads.join()
        try:
            return await self._read(receive, reader, limit)
        finally:
            self.reads.leave(reader)

    async def _read(self, receive, reader: Reader, limit: int) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks, size = [], 0
        while True:
            message = await self._next(receive, reader, deadline - loop.time())
            if message["type"] == "http.disconnect":
                raise Gone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Refused(413, f"body: larger than the limit of {limit} bytes", "request_too_large")
            chunks.append(chunk)
            reader.last = time.monotonic()
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _next(self, receive, reader: Reader, remaining: float) -> dict:
        """The next message from the client, unless the deadline passes or the read is cut first."""
        timeout = Refused(408, f"body: not received within {self.body_timeout_s:g} s", "request_timeout")
        if reader.cut.is_set():
            raise self._cut()
        if remaining <= 0:
            raise timeout
        get, cut = asyncio.ensure_future(receive()), asyncio.ensure_future(reader.cut.wait())
        try:
            done, _ = await asyncio.wait({get, cut}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (get, cut):
                if not task.done():
                    task.cancel()
        if get in done:
            return get.result()
        raise self._cut() if cut in done else timeout

    def _cut(self) -> Refused:
        return Refused(
            408,
            f"body: not received in time (more than {self.reads.limit} bodies were being read; the one that "
            "waited longest for its next bytes was cut)",
            "request_timeout",
        )

    @staticmethod
    async def _answer(e: Refused, rid: str, scope, receive, send) -> None:
        headers = {"X-Request-Id": rid}
        if e.close:  # the body was not read whole: the connection cannot carry another request
            headers["Connection"] = "close"
        body = error_body(e.message, e.param, "invalid_request_error", e.code, rid)
        await JSONResponse(body, status_code=e.status, headers=headers)(scope, receive, send)


def _replay(body: bytes, receive):
    """A receive that gives the body read (one message), then the client's own messages (its
    disconnect, which Serve's proxy watches for)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
