"""HTTP ingress: the OpenAI-compatible API in front of one Engine round loop (engine_loop.py).

The Engine here is the in-process one; its target and drafter are proxies to the target and
drafter deployments, so drafting and verification run in their own replicas while the decide
step (FLy's gate and window, tensor ops over the batch) runs here, between the two calls.

A request's way through a handler, each step able to end it with an OpenAI error body that
carries the request id (also in the X-Request-Id header) and nothing of the inside: the API key
(401), draining / loading / at capacity (503 with Retry-After, at once), the body's size (413,
before it is read), its shape (400 naming the field), the prompt tokenized in a worker thread
(400), admission by the engine loop (400), then the generation, streamed or collected. A client
that leaves at any step takes its request out of the engine. The detail of a server-side failure
goes to the log under the request id; the client is told to quote that id.
"""

import asyncio
import hmac
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.requests import ClientDisconnect

from fly_serve.engine import Engine
from fly_serve.loading import eos_ids, load_config, load_tokenizer
from fly_serve.params import ParamError, Params
from fly_serve.prompts import chat_text, encode
from fly_serve.weights import check_same_tokenizer

from .engine_loop import EngineLoop, Update
from .openai_api import (
    BodyError,
    ChatRequest,
    CompletionRequest,
    Shape,
    add_request_bodies,
    error_body,
    new_id,
    parse_body,
)
from .prometheus import ServingMetrics
from .remote_parts import DEFAULT_TIMEOUT_S, RemoteDrafter, RemoteLookup, RemoteScorer, wait
from .replica_pool import LiveReplicas, group_tag, unit_rank

log = logging.getLogger("ray.serve")  # the replica's log, where an operator looks up a request id

api = FastAPI(title="fly-serve")
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}

API_KEY_ENV = "FLY_API_KEY"
MIB = 2**20
DEFAULT_MAX_BODY_BYTES = 4 * MIB
DEFAULT_MAX_WAITING = 32
DEFAULT_ROUND_TIMEOUT_S = 1200.0
GRACEFUL_SHUTDOWN_S = 120.0  # Serve's wait for requests in flight when it stops the replica (profiles set theirs)
HEALTH_POLL_S = 2.0  # a handler waiting on the engine loop checks this often that the loop is sound
READY_WAIT_S = 5.0  # a request arriving while the model deployments start waits this long before its 503
PROBE_TIMEOUT_S = 30.0  # one readiness call to a model deployment (it may still be loading)
PROBE_RETRY_S = 1.0
RETRY_AFTER_S = 1  # what a 503 asks the client to wait
# Requests a replica takes beyond those in flight in the engine: the ones answered at once (a 503,
# a 4xx, /healthz, stats), so that Serve passes them on instead of queueing or shedding them.
ANSWERED_AT_ONCE = 32
CLIENT_CLOSED = 499  # the status of a request whose client left while its body was read (nginx's; nobody reads it)
DRAIN_POLL_S = 0.1
STOP_WAIT_S = 5.0  # at shutdown, for the engine thread to end what is left
# A prompt's length in characters proves it too long for the context only beyond this many
# characters per token: the longest token's text times a margin for normalizers that compose
# characters (NFC turns up to 3 into 1), so the check never rejects a prompt that would fit.
NORMALIZE_MARGIN = 4
_NOT_ID = re.compile(r"[^A-Za-z0-9._:-]")  # a client may choose Serve's request id: keep it to a token


def openapi_schema() -> dict:
    """FastAPI's document of the routes, with the request bodies that the handlers parse
    themselves (after the key and size checks) declared too."""
    if api.openapi_schema is None:
        doc = get_openapi(title=api.title, version=api.version, routes=api.routes)
        add_request_bodies(doc, REQUEST_BODIES)
        api.openapi_schema = doc
    return api.openapi_schema


api.openapi = openapi_schema


def serve_limits(max_batch: int, max_waiting: int) -> dict:
    """The ingress deployment's Serve options for a profile. Serve's own shedding answers a
    plain-text 503; ours answers the OpenAI error body with Retry-After. So Serve never sheds
    (no queue limit: a queued request is a connection the client holds, and it reaches the
    handler, and its 503, within milliseconds), and a replica takes every request ours may admit
    plus room for those it answers at once."""
    return {"max_ongoing_requests": max_batch + max_waiting + ANSWERED_AT_ONCE, "max_queued_requests": -1}


class ApiError(Exception):
    """An answer other than 200: its status, OpenAI error fields and headers. `counted`: the
    failure metric has already been counted where the failure happened (the engine loop)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
        counted: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers, self.counted = headers or {}, counted

    def body(self, request_id: str | None) -> dict:
        return error_body(self.message, self.param, self.kind, self.code, request_id)


@dataclass(frozen=True)
class Ids:
    """A request's two names. `engine`: unique here; the engine's request id, its KV-cache key
    and the response id. `quote`: the id the client sees in the error body and the X-Request-Id
    header and quotes to an operator; Serve's request id (which a client may choose, so it is
    never a key), or `engine` where there is none. `proxied`: Serve's proxy adds the header itself."""

    engine: str
    quote: str
    proxied: bool

    @classmethod
    def of(cls, request: Request, prefix: str) -> "Ids":
        engine = new_id(prefix)
        serve_id = request.headers.get("x-request-id")
        quote = _NOT_ID.sub("_", serve_id)[:128] if serve_id else engine
        return cls(engine, quote, serve_id is not None)

    def headers(self) -> dict:
        return {} if self.proxied else {"X-Request-Id": self.quote}


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, kind="server_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def failure_reason(status: int) -> str:
    """The `reason` of fly_num_requests_failed."""
    return "overloaded" if status == 503 else "rejected" if status < 500 else "error"


@api.exception_handler(ApiError)
async def _api_error(request: Request, e: ApiError):
    ids = Ids.of(request, "req")
    return JSONResponse(e.body(ids.quote), status_code=e.status, headers=e.headers | ids.headers())


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    """pydantic's 422 -> OpenAI's 400, naming the first bad field (bodies are parsed by the
    handlers; this covers anything else FastAPI validates)."""
    first = e.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    ids = Ids.of(request, "req")
    body = error_body(f"{param or 'body'}: {first.get('msg')}", param, request_id=ids.quote)
    return JSONResponse(body, status_code=400, headers=ids.headers())


def sse(body) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def resolve_api_key(profile_key: str | None) -> bytes | None:
    """The key every /v1 route requires: $FLY_API_KEY wins over the profile's; none (or empty): open."""
    key = os.environ.get(API_KEY_ENV) or profile_key
    return key.encode() if key else None


def authorized(header: str | None, key: bytes | None) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    if key is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    # Starlette decodes header values as latin-1, so this gives back the bytes that were sent
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1", "replace"), key)


def max_token_chars(tokenizer) -> int:
    """At least the characters any one token stands for: the longest token string of the
    vocabulary, added tokens included (byte-level BPE writes a character per byte, and a
    character is at least a byte; SentencePiece writes its pieces as they read)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class Slots:
    """The requests in flight in this replica, from admission to their last byte, at most
    `capacity` (max_batch running + max_waiting queued): past that a request is answered 503 at
    once instead of queueing without end. Keyed by request id, so that giving back twice (a
    stream's end, then its response's finalizer) gives back once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: set[str] = set()
        self._lock = threading.Lock()  # the finalizer may run on any thread

    def take(self, request_id: str) -> bool:
        with self._lock:
            if len(self._held) >= self.capacity:
                return False
            self._held.add(request_id)
            return True

    def give(self, request_id: str) -> bool:
        """True if it was held (and is given back now)."""
        with self._lock:
            if request_id not in self._held:
                return False
            self._held.remove(request_id)
            return True

    def __len__(self) -> int:
        return len(self._held)


@serve.deployment(
    name="FlyIngress",
    ray_actor_options={"num_cpus": 0.2},
    **serve_limits(8, DEFAULT_MAX_WAITING),  # the builder sets them from the profile
    graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
)
@serve.ingress(api)
class Ingress:
    def __init__(
        self,
        target_handle,
        drafter_handle=None,
        lookup_handle=None,
        *,
        model: str,
        drafter: str | None = None,
        served_model_name: str | None = None,
        max_batch: int = 8,
        max_model_len: int = 4096,
        defaults: dict | None = None,
        affinity_groups: int = 8,
        speculation_profile: dict | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
        remote_timeout_s: float = DEFAULT_TIMEOUT_S,
        round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        api_key: str | None = None,
    ):
        self.tokenizer = load_tokenizer(model)
        if drafter is not None:  # speculative decoding compares token ids
            check_same_tokenizer(self.tokenizer, load_tokenizer(drafter))
        self.model_name = served_model_name or model
        self.max_model_len = min(max_model_len, load_config(model).max_position_embeddings)
        # Handlers tokenize in worker threads on an instance of their own, never the engine's.
        self.text_tokenizer = load_tokenizer(model)
        self.max_prompt_chars = NORMALIZE_MARGIN * max_token_chars(self.text_tokenizer) * self.max_model_len
        self.max_body_bytes, self.remote_timeout_s = max_body_bytes, remote_timeout_s
        self.api_key = resolve_api_key(api_key)  # never logged
        # One drafting call per live drafter replica each round (replica_pool.py); this unit's
        # target calls are tagged with its rank, so each ingress replica keeps its own target.
        ctx = serve.get_replica_context()
        live = LiveReplicas(ctx.app_name, "FlyDrafter")
        drafter_part = (
            RemoteDrafter(drafter_handle, affinity_groups, remote_timeout_s, live) if drafter_handle else None
        )
        target_handle = target_handle.options(multiplexed_model_id=group_tag(unit_rank(ctx)))
        self.drafter_handle = drafter_handle
        scorer = RemoteScorer(target_handle, len(self.tokenizer), remote_timeout_s)
        engine = Engine(
            scorer,
            drafter_part,
            self.tokenizer,
            eos_ids(model, self.tokenizer),
            max_batch=max_batch,
            max_model_len=self.max_model_len,
            defaults=Params.from_dict(defaults or {}),
            speculation_profile=speculation_profile,
        )
        if lookup_handle is not None:
            engine.drafters["lookup"] = RemoteLookup(lookup_handle, remote_timeout_s)
        self.metrics = ServingMetrics()
        self.loop = EngineLoop(engine, self.metrics, round_timeout_s, on_round_failed=self._watch_target)
        self.target_handle = target_handle
        self.target_down: str | None = None  # why the last round failed, until the target answers again
        self._watching = threading.Lock()
        self.slots = Slots(max_batch + max_waiting)
        self.draining = False
        self.ready = threading.Event()
        self._probe_stop = threading.Event()
        probes = [("target", lambda: target_handle.release.remote([]))]
        if drafter_handle is not None:
            probes.append(("drafter", lambda: drafter_handle.release.remote([])))
        if lookup_handle is not None:
            probes.append(("lookup", lambda: lookup_handle.propose.remote([])))
        threading.Thread(target=self._probe, args=(probes,), name="fly-readiness", daemon=True).start()

    # ---- health, readiness, draining
    def _probe(self, probes: list[tuple[str, Callable]]) -> None:
        """Ready once every model deployment has answered a cheap call: their constructors
        (the weights) are done. Until then /healthz says "loading"."""
        for name, call in probes:
            while not self._probe_stop.is_set():
                try:
                    wait(call(), PROBE_TIMEOUT_S, f"{name} (readiness)")
                    break
                except Exception as e:
                    log.info("fly: %s is not answering yet (%s)", name, type(e).__name__)
                    self._probe_stop.wait(PROBE_RETRY_S)
        if not self._probe_stop.is_set():
            self.ready.set()
            log.info("fly: ready, every model deployment answers")

    def _watch_target(self, reason: str) -> None:
        """After a failed round: unhealthy (/healthz and new requests 503, Retry-After) until the
        target answers its health check again. A dead TP rank makes Serve rebuild the group (tens
        of seconds); a round that failed for another reason clears at the first probe."""
        self.target_down = reason
        if self._watching.acquire(blocking=False):
            threading.Thread(target=self._probe_target, name="fly-target-watch", daemon=True).start()

    def _probe_target(self) -> None:
        try:
            while not self._probe_stop.is_set():
                try:
                    wait(self.target_handle.healthy.remote(), PROBE_TIMEOUT_S, "target (health)")
                    break
                except Exception as e:
                    log.info("fly: the target is not healthy yet (%s)", type(e).__name__)
                    self._probe_stop.wait(PROBE_RETRY_S)
            log.info("fly: the target answers again after a failed round")
            self.target_down = None
        finally:
            self._watching.release()

    def _state(self) -> tuple[str, str]:
        """(status, why) for /healthz and admission: ready, unhealthy, draining or loading."""
        if problem := self.loop.problem():
            return "unhealthy", problem
        if self.target_down:
            return "unhealthy", "the target is recovering from a failed round; retry shortly"
        if self.draining:
            return "draining", "the service is shutting down; retry on another replica"
        if not self.ready.is_set():
            return "loading", "the models are loading"
        return "ready", ""

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica. Only faults
        that do not heal raise: a dead engine loop or a stuck round. Loading and draining do not
        (a replacement would cut the requests being drained)."""
        if problem := self.loop.problem():
            raise RuntimeError(problem)

    async def drain(self, timeout_s: float = 0.0) -> int:
        """Stop admitting: new generations get 503 (code "draining", Retry-After), /healthz 503,
        so load balancers move on, while requests in flight run to their end. Waits up to
        timeout_s for them; returns how many are still in flight. For launchers and operators
        (`serve.get_app_handle(app).drain.remote()`), and __del__."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while len(self.slots) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return len(self.slots)

    async def __del__(self):
        """Serve stops a replica by waiting (up to graceful_shutdown_timeout_s) until no request
        is ongoing, streams included, then calling this: whatever is still here is ended with an
        error, which a stream sends as its last event, instead of a cut connection."""
        if not hasattr(self, "loop"):  # the constructor did not finish
            return
        self._probe_stop.set()
        left = await self.drain()
        if left:
            log.warning("fly: stopping with %d requests in flight", left)
        self.loop.stop("the service is shutting down")
        await asyncio.to_thread(self.loop.thread.join, STOP_WAIT_S)

    # ---- routes
    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """200 "ready" once the models answer; 503 (OpenAI error body + status) while loading,
        draining or unhealthy. Open without an API key."""
        status, why = self._state()
        if status == "ready":
            return JSONResponse({"status": "ready", "engine_loop": True})
        body = error_body(why, None, "server_error", status) | {
            "status": status,
            "engine_loop": self.loop.thread.is_alive(),
        }
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @api.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        return await self._answer(request, "req", self._models)

    @api.get("/v1/fly/stats")
    async def stats(self, request: Request) -> Response:
        return await self._answer(request, "req", self._stats)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._answer(request, "cmpl", lambda ids: self._generate(request, ids, chat=False))

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._answer(request, "chatcmpl", lambda ids: self._generate(request, ids, chat=True))

    async def _answer(self, request: Request, prefix: str, work: Callable[[Ids], Awaitable[Response]]) -> Response:
        """One /v1 request: the key first, then `work`; whatever goes wrong is an OpenAI error
        body with the id to quote, the detail of an unexpected fault in the log only."""
        ids = Ids.of(request, prefix)
        try:
            if not authorized(request.headers.get("authorization"), self.api_key):
                raise ApiError(
                    401,
                    "a valid API key is required: send the header Authorization: Bearer <key>",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            response = await work(ids)
        except ApiError as e:
            return self._error_response(ids, e)
        except ClientDisconnect:  # the client left while sending its body: not a failure of ours
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            log.exception("fly: request %s (%s) failed", ids.quote, ids.engine)
            return self._error_response(
                ids, ApiError(500, f"internal error; quote request id {ids.quote}", kind="server_error")
            )
        response.headers.update(ids.headers())
        return response

    def _error_response(self, ids: Ids, e: ApiError) -> JSONResponse:
        if not e.counted:
            self.metrics.failure(failure_reason(e.status))
        return JSONResponse(e.body(ids.quote), status_code=e.status, headers=e.headers | ids.headers())

    async def _models(self, ids: Ids) -> JSONResponse:
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "fly-serve"}]
        return JSONResponse({"object": "list", "data": data})

    async def _stats(self, ids: Ids) -> JSONResponse:
        out = self.loop.snapshot() | {
            "status": self._state()[0],
            "in_flight": len(self.slots),
            "capacity": self.slots.capacity,
        }
        if self.drafter_handle is not None:
            out["drafter_cache"] = await self._drafter_cache()
        return JSONResponse(out)

    async def _drafter_cache(self) -> dict | None:
        try:
            return await asyncio.wait_for(self.drafter_handle.cache_report.remote(), self.remote_timeout_s)
        except Exception as e:  # stats never fail because a drafter replica is away
            log.warning("fly: drafter cache report failed (%s)", type(e).__name__)
            return None

    # ---- one generation
    async def _generate(self, request: Request, ids: Ids, chat: bool) -> Response:
        rid = ids.engine
        arrival = time.monotonic()
        await self._admissible()
        if not self.slots.take(rid):
            raise unavailable(
                f"the server is at capacity ({self.slots.capacity} requests in flight); retry later", "overloaded"
            )
        streaming = False
        try:
            body = await self._parse(request, ChatRequest if chat else CompletionRequest)
            if body.model not in (None, self.model_name):
                raise ApiError(
                    404,
                    f"model: {body.model!r} is not served here (try {self.model_name!r})",
                    "model",
                    code="model_not_found",
                )
            try:
                params = body.params()
                prompt = await asyncio.to_thread(self._prompt_ids, body, chat)
            except ParamError as e:
                raise ApiError(400, str(e), body.client_field(e.field)) from None
            updates = await self._submit(ids, body, prompt, params, arrival)
            shape = Shape(chat, rid, self.model_name)
            if not body.stream:
                return await self._collect(ids, updates, shape)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            response = StreamingResponse(
                self._stream(ids, updates, shape, include_usage), media_type="text/event-stream"
            )
            # A response dropped before it is sent (the client left just now) never starts the
            # stream, so the stream's own cleanup would never run: this one does.
            weakref.finalize(response, self._left, rid)
            streaming = True  # the stream gives the slot back when it ends
            return response
        finally:
            if not streaming:
                self.slots.give(rid)

    async def _admissible(self) -> None:
        """503 at once while draining or unhealthy; while loading, after a short wait (a request
        right after start-up usually finds the models answering)."""
        deadline = time.monotonic() + READY_WAIT_S
        while (state := self._state())[0] == "loading" and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        status, why = state
        if status != "ready":
            raise unavailable(why, status)

    async def _parse(self, request: Request, model: type) -> ChatRequest | CompletionRequest:
        """The request model; parsed in a worker thread, as a body of megabytes takes a while."""
        raw = await self._read_body(request)
        try:
            return await asyncio.to_thread(parse_body, raw, model)
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 past max_body_bytes: from Content-Length before reading
        anything, else while reading."""
        limit = self.max_body_bytes
        too_large = ApiError(413, f"body: larger than the limit of {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _prompt_ids(self, body, chat: bool) -> list[int]:
        """The prompt's token ids, in a worker thread: a long prompt holds up neither the event
        loop nor the engine thread. A prompt whose length alone proves it past the context is
        refused without tokenizing it."""
        tok = self.text_tokenizer
        if chat:
            text = chat_text(tok, [m.model_dump() for m in body.messages])
        else:
            text = body.prompt_input()
            if not isinstance(text, str):
                return text  # token ids: the engine checks their range
        if len(text) > self.max_prompt_chars:
            raise ParamError("prompt", f"longer than the context window of {self.max_model_len} tokens")
        return encode(tok, text, bos=not chat)  # a chat template renders its own BOS

    async def _submit(self, ids: Ids, body, prompt: list[int], params: dict, arrival: float) -> asyncio.Queue:
        """Posts the request to the engine loop; the queue then receives its updates. A client
        that leaves meanwhile takes the request out again."""
        updates: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(update: Update) -> None:  # called on the engine thread
            aloop.call_soon_threadsafe(updates.put_nowait, update)

        admitted = asyncio.wrap_future(self.loop.submit(prompt, params, ids.engine, sink, arrival))
        try:
            await self._watch(ids, lambda: asyncio.shield(admitted))
        except ParamError as e:
            raise ApiError(400, str(e), body.client_field(e.field)) from None
        except BaseException:  # the client left, or the loop is down: never leave the request running
            admitted.cancel()
            self.loop.abort(ids.engine)
            raise
        return updates

    async def _watch(self, ids: Ids, step: Callable[[], Awaitable]):
        """Awaits step(), checking every HEALTH_POLL_S that the engine loop is sound, so that no
        request waits forever on a loop that is gone or stuck."""
        while True:
            try:
                return await asyncio.wait_for(step(), HEALTH_POLL_S)
            except TimeoutError:
                if problem := self.loop.problem():
                    raise self._failed(ids, problem, counted=False) from None

    def _failed(self, ids: Ids, detail: str, counted: bool = True) -> ApiError:
        """A generation that failed: the detail to the log under the id, the id to the client."""
        log.error("fly: request %s (%s): generation failed: %s", ids.quote, ids.engine, detail)
        msg = f"generation failed; quote request id {ids.quote}"
        return ApiError(500, msg, kind="server_error", counted=counted)

    async def _collect(self, ids: Ids, updates: asyncio.Queue, shape: Shape) -> JSONResponse:
        parts, last = [], None
        try:
            while last is None:
                u = await self._watch(ids, updates.get)
                parts.append(u.text)
                last = u if u.finish_reason else None
        finally:
            if last is None:
                self.loop.abort(ids.engine)  # the client went away: free the slot
        if last.error:
            raise self._failed(ids, last.error)
        return JSONResponse(shape.full("".join(parts), last))

    def _left(self, rid: str) -> None:
        if self.slots.give(rid):
            self.loop.abort(rid)

    async def _stream(self, ids: Ids, updates: asyncio.Queue, shape: Shape, include_usage: bool):
        done = False
        try:
            if shape.chat:
                yield sse(shape.chunk(None, role=True))
            while not done:
                u = await self._watch(ids, updates.get)
                done = u.finish_reason is not None
                if u.error:
                    raise self._failed(ids, u.error)
                if u.text or done:
                    chunk = shape.chunk(u.text, u.finish_reason)
                    if done and not include_usage:
                        chunk |= {"usage": shape.usage(u), "fly": u.fly}
                    yield sse(chunk)
            if include_usage:
                yield sse(shape.usage_chunk(u))
            yield sse("[DONE]")
        except ApiError as e:  # headers are sent: the error is the stream's last event
            if not e.counted:
                self.metrics.failure(failure_reason(e.status))
            yield sse(e.body(ids.quote))
            yield sse("[DONE]")
        except Exception:
            log.exception("fly: request %s (%s): stream failed", ids.quote, ids.engine)
            self.metrics.failure("error")
            msg = f"internal error; quote request id {ids.quote}"
            yield sse(error_body(msg, None, "server_error", request_id=ids.quote))
            yield sse("[DONE]")
        finally:
            self.slots.give(ids.engine)
            if not done:
                self.loop.abort(ids.engine)
