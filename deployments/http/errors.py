"""Answers other than 200, in one place: an exception becomes an OpenAI error body with the id
to quote, and the failure metric is counted here and nowhere else (the middleware calls
`answer` for a response not yet started, a stream for its last event)."""

import logging

from starlette.requests import ClientDisconnect

from .openai_api import error_body
from .request_ids import Ids

log = logging.getLogger("ray.serve")  # the replica's log, where an operator looks up a request id

RETRY_AFTER_S = 1  # what a 503 asks the client to wait
CLIENT_CLOSED = 499  # the status of a request whose client left while its body was read (nginx's; nobody reads it)


class ApiError(Exception):
    """An answer other than 200: its status, OpenAI error fields and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self, request_id: str | None) -> dict:
        return error_body(self.message, self.param, self.kind, self.code, request_id)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, kind="server_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def generation_failed(ids: Ids, detail: str) -> ApiError:
    """A generation that failed: the detail to the log under the id, the id to the client."""
    log.error("fly: request %s (%s): generation failed: %s", ids.client_id, ids.engine, detail)
    return ApiError(500, f"generation failed; quote request id {ids.client_id}", kind="server_error")


def failure_reason(status: int) -> str:
    """The `reason` of fly_num_requests_failed."""
    return "overloaded" if status == 503 else "rejected" if status < 500 else "error"


class ErrorAnswers:
    """Turns what a request raised into the ApiError its client is told, counting it once.
    `metrics`: a ServingMetrics (ingress/metrics.py; None until the ingress has built one)."""

    def __init__(self, metrics=None):
        self.metrics = metrics

    def answer(self, e: BaseException, ids: Ids) -> ApiError | None:
        """None: nobody to answer (the client left while sending its body: not a failure of ours)."""
        if isinstance(e, ClientDisconnect):
            return None
        if not isinstance(e, ApiError):
            log.error("fly: request %s (%s) failed", ids.client_id, ids.engine, exc_info=e)
            e = ApiError(500, f"internal error; quote request id {ids.client_id}", kind="server_error")
        if self.metrics is not None:
            self.metrics.failure(failure_reason(e.status))
        return e
