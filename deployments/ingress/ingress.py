"""HTTP ingress: the OpenAI-compatible API in front of one Engine round loop (engine_loop.py).

The Engine here is the in-process one; its target is a proxy to the target deployment and its
drafter a proxy to the drafter pool (or, with drafter_placement "ingress", the draft model in
this process), so verification runs in its own replica while the decide step (FLy's gate and
window, tensor ops over the batch) runs here, between the calls. With target_placement "ingress"
(tp_size 1) the target is loaded here too: the CPU profile's shape, where one process computing
beats two processes taking turns on the same cores.

What runs before a handler is middleware.py (request ids, the API key, exceptions to OpenAI error
bodies and the failure metric, errors.py). A generation's way through its handler, each step able
to end it with an error that carries the request id: draining / loading / unhealthy (503 with
Retry-After, at once), the body's size (413, before it is read) and its time (408 past
body_timeout_s; the HTTP proxy's guard, http/proxy_guard.py, has read it whole already and applied
both, so a slow client waits there and holds none of this replica's Serve places: these are for a
proxy without it), its shape (400 naming the field), at capacity (503: a slot is taken only for a
body read and parsed), the prompt tokenized and its grammar compiled
in worker threads (tokenization.py, grammar.py, 400), admission by the engine loop (400), then the
generation, collected or streamed (sse.py). A client that leaves at any step takes its request out
of the engine. Whether the parts are sound is health.py's.
"""

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.requests import ClientDisconnect

from deployments.http.admission import Slots, serve_limits
from deployments.http.errors import RETRY_AFTER_S, ApiError, ErrorAnswers, generation_failed, log, unavailable
from deployments.http.middleware import Guard, RequestMiddleware, resolve_api_key
from deployments.http.openai_api import (
    BodyError,
    ChatRequest,
    CompletionRequest,
    ResponseBodies,
    add_request_bodies,
    error_body,
    parse_body,
)
from deployments.http.request_ids import Ids
from deployments.parts.drafter_replica import deployment_name
from deployments.parts.remote_parts import RemoteDrafter, RemoteScorer
from deployments.parts.threads import serve_at_priority, threads_from_ray
from deployments.profiles.app_args import DEFAULT_MAX_WAITING, AppArgs
from deployments.routing.replica_pool import LiveReplicas, group_tag, unit_rank
from deployments.routing.unit_router import STATUS
from fly_serve.build import assemble_engine, drafts_under_grammar, load_drafter, load_scorer
from fly_serve.engine.params import ParamError
from fly_serve.loading.loading import load_tokenizer, set_threads
from fly_serve.runtime.devices import device_for

from .calibration import calibrate_served
from .engine_loop import EngineLoop, Update
from .health import Part, Prober
from .metrics import ServingMetrics
from .sse import events
from .stream_pacing import WHOLE, Pacer
from .tokenization import PromptEncoder

api = FastAPI(title="fly-serve")
api.add_middleware(RequestMiddleware)
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}

GRACEFUL_SHUTDOWN_S = 120.0  # Serve's wait for requests in flight when it stops the replica (profiles set theirs)
HEALTH_POLL_S = 2.0  # a handler waiting on the engine loop checks this often that the loop is sound
READY_WAIT_S = 5.0  # a request arriving while the parts start (or are probed) waits this long before its 503
DRAIN_POLL_S = 0.1
STOP_WAIT_S = 5.0  # at shutdown, for the engine thread to end what is left
CALIBRATION_TIMEOUT_S = 1800.0  # k auto's measurement at start (tens of seconds on a small CPU)


def openapi_schema() -> dict:
    """FastAPI's document of the routes, with the request bodies that the handlers parse
    themselves (after the key and size checks) declared too."""
    if api.openapi_schema is None:
        doc = get_openapi(title=api.title, version=api.version, routes=api.routes)
        add_request_bodies(doc, REQUEST_BODIES)
        api.openapi_schema = doc
    return api.openapi_schema


api.openapi = openapi_schema


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    """pydantic's 422 -> OpenAI's 400 naming the first bad field, answered by the middleware like
    every other error (bodies are parsed by the handlers; this covers anything else FastAPI
    validates)."""
    first = e.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    raise ApiError(400, f"{param or 'body'}: {first.get('msg')}", param) from None


@serve.deployment(
    name="FlyIngress",
    ray_actor_options={"num_cpus": 0.2},
    **serve_limits(8, DEFAULT_MAX_WAITING),  # the builder sets them from the profile
    graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
)
@serve.ingress(api)
class Ingress:
    def __init__(self, target_handle, drafter_handle=None, *, args: AppArgs):
        """drafter_handle: the drafter pool (of the default drafter), or {name: pool} for several
        (app.bind_drafters); None: the draft models in this process (drafter_placement ingress)."""
        serve_at_priority(args.serving_nice)  # first: the engine loop and drafter threads inherit it
        config = args.engine_config()
        self.model_name, self.call_timeout_s, self.max_body_bytes, self.body_timeout_s, self.stream_interval_s = (
            args.model_name,
            args.call_timeout_s,
            args.max_body_bytes,
            args.body_timeout_s,
            args.stream_interval_s,
        )
        self.metrics = ServingMetrics()
        self.errors = ErrorAnswers(self.metrics)
        # This unit's target calls are tagged with its rank, so each ingress replica keeps its own target.
        ctx = serve.get_replica_context()
        unit = unit_rank(ctx)
        api_key = resolve_api_key(args.api_key.get_secret_value() if args.api_key else None)
        api.state.fly = Guard(api_key, self.errors, unit)
        tokenizer = load_tokenizer(config.target)
        if target_handle is not None:
            target_handle = target_handle.options(multiplexed_model_id=group_tag(unit))
        names = list(config.drafter_specs())  # the draft models by name, the default first
        handles = drafter_handle if isinstance(drafter_handle, dict) else {}
        if drafter_handle is not None and not handles:
            handles = {names[0]: drafter_handle}
        self.drafter_handles = handles
        local = not handles and args.drafter_placement == "ingress" and bool(names)
        self.live_replicas: dict[str, LiveReplicas] = {}  # each remote pool's replica count, as rounds see it

        def build_engine():
            device = device_for(ray.get_gpu_ids())
            if target_handle is None:  # target_placement "ingress": one OpenMP team for both models
                set_threads(args.target_threads or threads_from_ray())
                scorer = load_scorer(config, device=device)
            else:
                scorer = RemoteScorer(target_handle, len(tokenizer), args.call_timeout_s)
            drafters = {}
            for name, handle in handles.items():  # one drafting call per live replica of each pool (replica_pool.py)
                live = self.live_replicas[name] = LiveReplicas(ctx.app_name, deployment_name(name, names[0]))
                grammars = drafts_under_grammar(config, name, tokenizer)
                drafters[name] = RemoteDrafter(handle, args.affinity_groups, args.call_timeout_s, live, grammars)
            if local:
                if target_handle is not None:  # else the target's threads are the drafter's (one team)
                    set_threads(args.drafter_threads or threads_from_ray())
                drafters = {name: load_drafter(config, device=device, name=name) for name in names}
            return assemble_engine(config, scorer, drafters or None, tokenizer)

        # The loop's thread loads the local parts (drafter, target) and runs every round: the
        # process's torch work on one thread (threads.py). The prober is made next; no round can
        # fail before a request comes.
        self.loop = EngineLoop(
            build_engine, self.metrics, args.stuck_round_s, on_round_failed=lambda why: self.prober.round_failed(why)
        )
        engine = self.loop.engine
        # the draft models in this process, by name (their cache reports)
        self.local_drafters = {n: engine.model_drafter(n) for n in engine.drafter_names} if local else {}
        self.prompts = PromptEncoder(config.target, engine.max_model_len)
        # ready once every part answers and k auto's cost profile is measured (calibration.py), on
        # the loop's thread too
        self.prober = Prober(self._parts(target_handle, handles), on_ready=lambda: self._calibrate(engine, args))
        self.slots = Slots(args.max_batch + args.max_waiting)
        self.ongoing_limit = serve_limits(args.max_batch, args.max_waiting)["max_ongoing_requests"]  # Serve's
        self.draining = False

    def _calibrate(self, engine, args: AppArgs) -> None:
        """k auto's profile, on the loop's thread; a loop that stops meanwhile leaves the default
        cost shape (calibrate_served handles its own failures the same way)."""
        try:
            self.loop.call(lambda: calibrate_served(engine, args)).result(timeout=CALIBRATION_TIMEOUT_S)
        except Exception:
            log.warning("fly: calibration did not run; k auto starts from the default cost shape", exc_info=True)

    @staticmethod
    def _parts(target_handle, drafter_handles: dict) -> list[Part]:
        """The remote parts the prober watches (a part in this process answers if the loop does)."""
        parts = [] if target_handle is None else [Part("target", lambda: target_handle.healthy.remote())]
        for i, (name, handle) in enumerate(drafter_handles.items()):
            what = "drafter pool" if i == 0 else f"drafter pool {name}"
            parts.append(Part(what, lambda h=handle: h.healthy.remote()))
        return parts

    # ---- health, readiness, draining
    def _state(self) -> tuple[str, str]:
        """(status, why) for /healthz and admission: ready, unhealthy, draining or loading."""
        if problem := self.loop.problem():
            return "unhealthy", problem
        if self.prober.broken:
            return "unhealthy", self.prober.broken
        if self.draining:
            return "draining", "the service is shutting down; retry on another replica"
        if not self.prober.ready.is_set():
            return "loading", "the models are loading"
        return "ready", ""

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica. Only faults
        that do not heal raise: a dead engine loop or a stuck round. Loading and draining do not
        (a replacement would cut the requests being drained)."""
        if problem := self.loop.problem():
            raise RuntimeError(problem)

    def record_routing_stats(self) -> dict:
        """What the HTTP proxy's router (unit_router.py) reads of this unit, every few seconds:
        a unit that is not ready gets no new sessions while another is."""
        return {STATUS: self._state()[0]}

    async def drain(self) -> int:
        """Stop admitting: new generations get 503 (code "draining", Retry-After), /healthz 503,
        so load balancers move on, while requests in flight run to their end. Returns how many
        are in flight now (launch.py polls `in_flight` until none is left)."""
        self.draining = True
        return len(self.slots)

    async def in_flight(self) -> int:
        """Requests admitted and not yet answered to their last byte; changes nothing."""
        return len(self.slots)

    async def __del__(self):
        """Serve stops a replica by waiting (up to graceful_shutdown_timeout_s) until no request
        is ongoing, streams included, then calling this: whatever is still here is ended with an
        error, which a stream sends as its last event, instead of a cut connection."""
        if not hasattr(self, "prober"):  # the constructor did not finish
            if hasattr(self, "loop"):
                self.loop.stop("the replica did not start")
            return
        self.prober.stop()
        if left := await self.drain():
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
    async def list_models(self) -> JSONResponse:
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "fly-serve"}]
        return JSONResponse({"object": "list", "data": data})

    @api.get("/v1/fly/stats")
    async def stats(self) -> JSONResponse:
        out = self.loop.snapshot() | {
            "status": self._state()[0],
            "in_flight": len(self.slots),
            "capacity": self.slots.capacity,
            "ongoing_limit": self.ongoing_limit,  # Serve's max_ongoing_requests of this replica
        }
        names = list(self.local_drafters or self.drafter_handles)
        if names:  # the default drafter's as it always was, and every drafter's by name
            reports = {name: await self._drafter_cache(name) for name in names}
            out["drafter_cache"] = reports[names[0]]
            out["drafter_caches"] = reports
        if self.live_replicas:  # each drafter pool's replicas that the rounds split rows among
            out["drafter_replicas"] = {name: live.last for name, live in self.live_replicas.items()}
        return JSONResponse(out)

    async def _drafter_cache(self, name: str) -> dict | None:
        if name in self.local_drafters:
            return self.local_drafters[name].cache_report()
        try:
            return await asyncio.wait_for(self.drafter_handles[name].cache_report.remote(), self.call_timeout_s)
        except Exception as e:  # stats never fail because a drafter replica is away
            log.warning("fly: drafter %s cache report failed (%s)", name, type(e).__name__)
            return None

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    # ---- one generation
    async def _generate(self, request: Request, chat: bool) -> Response:
        ids: Ids = request.state.ids
        rid, arrival = ids.engine, time.monotonic()
        await self._admissible()
        # The body is read (within body_timeout_s) and parsed before a slot is taken: a client
        # that sends its body slowly, or never, holds no place of the engine's meanwhile.
        body = await self._parse(request, ChatRequest if chat else CompletionRequest)
        if not self.slots.take(rid):
            raise unavailable(
                f"the server is at capacity ({self.slots.capacity} requests in flight); retry later", "overloaded"
            )
        streaming = False
        try:
            if body.model not in (None, self.model_name):
                raise ApiError(
                    404,
                    f"model: {body.model!r} is not served here (try {self.model_name!r})",
                    "model",
                    code="model_not_found",
                )
            try:
                params = body.params()
                prompt = await asyncio.to_thread(self.prompts.prompt_ids, body, chat)
                # a grammar is compiled and tried here, in a worker thread: one the library
                # cannot follow is this request's 400, and the engine thread gets it compiled
                matcher = await asyncio.to_thread(self.loop.check_grammar, params)
            except ParamError as e:
                raise ApiError(400, str(e), body.client_field(e.field)) from None
            updates = await self._submit(ids, body, prompt, params, arrival, matcher)
            bodies = ResponseBodies(chat, rid, self.model_name)
            if not body.stream:
                return await self._collect(ids, updates, bodies, body.client_field)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            response = StreamingResponse(
                self._stream(ids, updates, bodies, include_usage, body.client_field), media_type="text/event-stream"
            )
            # A response dropped before it is sent (the client left just now) never starts the
            # stream, so the stream's own cleanup would never run: this one does.
            weakref.finalize(response, self._end_if_unanswered, rid)
            streaming = True  # the stream gives the slot back when it ends
            return response
        finally:
            if not streaming:
                self.slots.give(rid)

    async def _admissible(self) -> None:
        """503 at once while draining or unhealthy; while loading, or while the parts are being
        probed after a failed round, after a short wait for the verdict."""
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            state = self._state()
            if not (state[0] == "loading" or (state[0] == "ready" and self.prober.checking.is_set())):
                break
            await asyncio.sleep(DRAIN_POLL_S)
        status, why = self._state()
        if status != "ready":
            raise unavailable(why, status)

    async def _parse(self, request: Request, model: type) -> ChatRequest | CompletionRequest:
        """The request model; parsed in a worker thread, as a body of megabytes takes a while."""
        raw = await self._read_body(request, request.state.ids)
        try:
            return await asyncio.to_thread(parse_body, raw, model)
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None

    async def _read_body(self, request: Request, ids: Ids) -> bytes:
        """The body, refused with 413 past max_body_bytes (from Content-Length before reading
        anything, else while reading), and with 408 when it has not all come within
        body_timeout_s (a client that declares a body and sends it slowly, or never). A client
        that leaves meanwhile is ClientDisconnect, however the transport said so: a 499 nobody
        reads, one line in the log, no traceback (errors.ErrorAnswers)."""
        limit = self.max_body_bytes
        too_large = ApiError(413, f"body: larger than the limit of {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(
                408, f"body: not received within {self.body_timeout_s:g} s", code="request_timeout"
            ) from None
        except (ApiError, ClientDisconnect):
            raise
        except Exception as e:  # what Serve's receive met fetching the body from its proxy: the client left
            log.info("fly: request %s: its client left before its body was read (%s)", ids.client_id, type(e).__name__)
            raise ClientDisconnect() from None
        return b"".join(chunks)

    async def _submit(self, ids: Ids, body, prompt: list[int], params: dict, arrival: float, matcher) -> asyncio.Queue:
        """Posts the request to the engine loop; the queue then receives its updates. A client
        that leaves meanwhile takes the request out again."""
        updates: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def deliver(update: Update) -> None:  # called on the engine thread
            aloop.call_soon_threadsafe(updates.put_nowait, update)

        sink = Pacer(deliver, self.stream_interval_s if body.stream else WHOLE)

        messages = [m.for_template() for m in body.messages] if isinstance(body, ChatRequest) else None
        admitted = asyncio.wrap_future(self.loop.submit(prompt, params, ids.engine, sink, arrival, messages, matcher))
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
                    raise generation_failed(ids, problem) from None

    async def _updates(self, ids: Ids, queue: asyncio.Queue, client_field: Callable) -> AsyncIterator[Update]:
        """A request's updates up to its last; a failed generation raises: the client's error
        where its own input ended it (a grammar with no way on: 400 naming the field), else a
        500 (the detail to the log). client_field: the request body's (an engine field as sent)."""
        while True:
            u = await self._watch(ids, queue.get)
            if u.error and u.error_param:
                field = client_field(u.error_param)
                log.info("fly: request %s (%s): ended by its %s: %s", ids.client_id, ids.engine, field, u.error)
                raise ApiError(400, f"{field}: {u.error}", field, code="grammar_dead_end")
            if u.error:
                raise generation_failed(ids, u.error)
            yield u
            if u.finish_reason:
                return

    async def _collect(self, ids: Ids, queue: asyncio.Queue, bodies: ResponseBodies, client_field) -> JSONResponse:
        parts, last = [], None
        try:
            async for u in self._updates(ids, queue, client_field):
                parts.append(u.text)
                last = u
        finally:
            if last is None or not last.finish_reason:
                self.loop.abort(ids.engine)  # the client went away (or it failed): free the slot
        return JSONResponse(bodies.full("".join(parts), last))

    def _end_if_unanswered(self, rid: str) -> None:
        """A response dropped unsent: its slot and its engine request end here."""
        if self.slots.give(rid):
            self.loop.abort(rid)

    async def _stream(self, ids: Ids, queue: asyncio.Queue, bodies: ResponseBodies, include_usage: bool, client_field):
        done = False

        def error_event(e: BaseException) -> dict:
            return self.errors.answer(e, ids).body(ids.client_id)

        try:
            updates = self._updates(ids, queue, client_field)
            async for event in events(updates, bodies, include_usage, error_event):
                done = done or event == "data: [DONE]\n\n"
                yield event
        finally:
            self.slots.give(ids.engine)
            if not done:
                self.loop.abort(ids.engine)
