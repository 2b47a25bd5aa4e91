"""HTTP ingress: the OpenAI-compatible API in front of one Engine round loop (loop.py).

The Engine here is the in-process one; its target and drafter are proxies to the target and
drafter deployments, so drafting and verification run in their own replicas while the decide
step (FLy's gate and window, tensor ops over the batch) runs here, between the two calls.
"""

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from fly_serve.engine import Engine
from fly_serve.loading import eos_ids, load_config, load_tokenizer
from fly_serve.params import ParamError, Params
from fly_serve.prompts import chat_text
from fly_serve.weights import check_same_tokenizer

from .engine_loop import EngineLoop
from .openai_api import ChatRequest, CompletionRequest, Shape, error_body, new_id
from .prometheus import RoundMetrics
from .remote_parts import RemoteDrafter, RemoteLookup, RemoteScorer

api = FastAPI(title="fly-serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None, kind="invalid_request_error", code=None):
        self.status, self.body = status, error_body(message, param, kind, code)


@api.exception_handler(ApiError)
async def _api_error(request: Request, e: ApiError):
    return JSONResponse(e.body, status_code=e.status)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    """pydantic's 422 -> OpenAI's 400, naming the first bad field ("fly.k", "messages.0.role")."""
    first = e.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return JSONResponse(error_body(f"{param or 'body'}: {first.get('msg')}", param), status_code=400)


def request_field(body, param: str | None) -> str | None:
    """Name an engine field as the client sent it: "fly.k", "messages" for a chat prompt."""
    if param == "prompt" and isinstance(body, ChatRequest):
        return "messages"
    if body.fly is not None and param in body.fly.model_fields_set:
        return f"fly.{param}"
    return param


def sse(body) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


@serve.deployment(name="FlyIngress", ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=64)
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
        affinity_groups: int = 1,
    ):
        self.tokenizer = load_tokenizer(model)
        if drafter is not None:  # speculative decoding compares token ids
            check_same_tokenizer(self.tokenizer, load_tokenizer(drafter))
        self.model_name = served_model_name or model
        max_model_len = min(max_model_len, load_config(model).max_position_embeddings)
        drafter = RemoteDrafter(drafter_handle, affinity_groups) if drafter_handle else None
        self.drafter_handle = drafter_handle
        scorer = RemoteScorer(target_handle, len(self.tokenizer))
        engine = Engine(
            scorer,
            drafter,
            self.tokenizer,
            eos_ids(model, self.tokenizer),
            max_batch=max_batch,
            max_model_len=max_model_len,
            defaults=Params.from_dict(defaults or {}),
        )
        if lookup_handle is not None:
            engine.drafters["lookup"] = RemoteLookup(lookup_handle)
        self.loop = EngineLoop(engine, RoundMetrics())

    # ---- routes
    @api.get("/healthz")
    def healthz(self):
        return {"status": "ok", "engine_loop": self.loop.thread.is_alive()}

    @api.get("/v1/models")
    def list_models(self):
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "fly-serve"}],
        }

    @api.get("/v1/fly/stats")
    async def stats(self):
        out = self.loop.snapshot()
        if self.drafter_handle is not None:
            out["drafter_cache"] = await self.drafter_handle.cache_report.remote()
        return out

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._serve(body, chat=False, prompt=lambda: body.prompt_input())

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest):
        return await self._serve(
            body, chat=True, prompt=lambda: chat_text(self.tokenizer, [m.model_dump() for m in body.messages])
        )

    # ---- one request
    async def _serve(self, body, chat: bool, prompt):
        if body.model not in (None, self.model_name):
            raise ApiError(
                404,
                f"model: {body.model!r} is not served here (try {self.model_name!r})",
                "model",
                code="model_not_found",
            )
        rid = new_id("chatcmpl" if chat else "cmpl")
        updates = await self._start(rid, body, prompt)
        shape = Shape(chat, rid, self.model_name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(rid, updates, shape, include_usage), media_type="text/event-stream")
        return await self._collect(rid, updates, shape)

    async def _start(self, rid, body, prompt) -> asyncio.Queue:
        try:
            params, text = body.params(), prompt()
        except ParamError as e:
            raise ApiError(400, str(e), e.field) from e
        updates: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def sink(update):  # called on the engine thread
            aloop.call_soon_threadsafe(updates.put_nowait, update)

        try:
            await asyncio.wrap_future(self.loop.submit(text, params, rid, sink))
        except ParamError as e:
            raise ApiError(400, str(e), request_field(body, e.field)) from e
        except asyncio.CancelledError:  # the client left: never leave its request running
            self.loop.abort(rid)
            raise
        return updates

    async def _collect(self, rid, updates, shape):
        parts, last = [], None
        try:
            while last is None:
                u = await updates.get()
                parts.append(u.text)
                last = u if u.finish_reason else None
        finally:
            if last is None:
                self.loop.abort(rid)  # the client went away: free the slot
        if last.error:
            raise ApiError(500, f"generation failed: {last.error}", None, kind="server_error")
        return shape.full("".join(parts), last)

    async def _stream(self, rid, updates, shape, include_usage):
        done = False
        try:
            if shape.chat:
                yield sse(shape.chunk(None, role=True))
            while not done:
                u = await updates.get()
                done = u.finish_reason is not None
                if u.error:
                    yield sse(error_body(f"generation failed: {u.error}", None, "server_error"))
                    break
                if u.text or done:
                    chunk = shape.chunk(u.text, u.finish_reason)
                    if done and not include_usage:
                        chunk |= {"usage": shape.usage(u), "fly": u.fly}
                    yield sse(chunk)
            if done and include_usage:
                yield sse(shape.usage_chunk(u))
            yield sse("[DONE]")
        finally:
            if not done:
                self.loop.abort(rid)
