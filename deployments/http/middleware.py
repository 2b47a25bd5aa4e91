"""The ingress's middleware (Ray Serve LLM's habit: request ids, auth and errors around the
routes, so that the handlers are left with routing and streaming). One pure ASGI layer, run
before any handler:

- names the request (request_ids.Ids, in `request.state.ids`) and puts its id in X-Request-Id,
  and the serving unit that answers in X-Fly-Unit;
- refuses a /v1 request without the API key (401);
- turns whatever a handler raises before its response starts into an OpenAI error body with the
  id to quote (errors.ErrorAnswers, which also counts the failure metric);
- warns once when a request came through a Serve proxy without its guard (proxy_guard.py): its
  body is then read here, where a slow one holds one of the replica's Serve places.

It reads the replica's settings from `app.state.fly` (a Guard the ingress sets in its
constructor: Serve builds one FastAPI app per replica process).
"""

import hmac
import os
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from .errors import CLIENT_CLOSED, ApiError, ErrorAnswers, log
from .proxy_guard import MARK, PROXY_HOOK_ENV
from .request_ids import Ids

API_KEY_ENV = "FLY_API_KEY"
# The prefix of the engine's request id (and the response id) by route, as OpenAI's
ID_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}


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


@dataclass
class Guard:
    api_key: bytes | None  # never logged
    errors: ErrorAnswers
    unit: int | None = None  # the serving unit (ingress replica rank), in X-Fly-Unit


def route_path(scope) -> str:
    """The path within the app (Serve may leave its route prefix in `path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class RequestMiddleware:
    def __init__(self, app):
        self.app = app
        self.unguarded_seen = False

    def _check_guarded(self, scope, headers: Headers) -> None:
        if self.unguarded_seen or scope.get("method") != "POST" or MARK.decode() in headers:
            return
        self.unguarded_seen = True
        log.warning(
            "fly: requests reach this replica through a Serve HTTP proxy without fly's guard, so their "
            "bodies are read here and a slow one holds a Serve place of this replica until its deadline; "
            "start Ray on every node with %s set (deployments/http/proxy_guard.py)",
            PROXY_HOOK_ENV,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = route_path(scope), Headers(scope=scope)
        ids = Ids.of(headers.get("x-request-id"), ID_PREFIXES.get(path, "req"))
        scope.setdefault("state", {})["ids"] = ids
        guard: Guard | None = getattr(scope["app"].state, "fly", None)
        self._check_guarded(scope, headers)
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in ids.headers().items()]
                if guard and guard.unit is not None:  # which unit answered: X-Session-Id's pin made visible
                    extra.append((b"x-fly-unit", str(guard.unit).encode()))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            if path.startswith("/v1") and guard and not authorized(headers.get("authorization"), guard.api_key):
                raise ApiError(
                    401,
                    "a valid API key is required: send the header Authorization: Bearer <key>",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            if started:  # the response is under way (a stream answers its own errors): nothing to send
                raise
            error = (guard.errors if guard else ErrorAnswers()).answer(e, ids)
            if error is None:
                response = Response(status_code=CLIENT_CLOSED)
            else:
                response = JSONResponse(error.body(ids.client_id), status_code=error.status, headers=error.headers)
            await response(scope, receive, send_with_id)
