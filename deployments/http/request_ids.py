"""A request's two names, given by the middleware before any handler runs."""

import re
import uuid
from dataclasses import dataclass

_NOT_ID = re.compile(r"[^A-Za-z0-9._:-]")  # a client may choose Serve's request id: keep it to a token


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Ids:
    """`engine`: unique here; the engine's request id, its KV-cache key and the response id.
    `client_id`: the id the client sees in the error body and the X-Request-Id header and quotes
    to an operator: Serve's request id (which a client may choose, so it is never a key), or
    `engine` where there is none. `proxied`: Serve's proxy adds the header itself."""

    engine: str
    client_id: str
    proxied: bool

    @classmethod
    def of(cls, serve_id: str | None, prefix: str) -> "Ids":
        engine = new_id(prefix)
        client_id = _NOT_ID.sub("_", serve_id)[:128] if serve_id else engine
        return cls(engine, client_id, serve_id is not None)

    def headers(self) -> dict:
        return {} if self.proxied else {"X-Request-Id": self.client_id}
