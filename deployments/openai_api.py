"""OpenAI wire format: request bodies (pydantic), response / chunk bodies, error bodies.

Unknown top-level fields are ignored (clients send many); the `fly` object is strict, since a
mistyped knob silently ignored would measure the wrong thing. Every field is parsed strictly, as
OpenAI's API does: a number is a JSON number (not "0.5", not true), an integer has no fraction.
OpenAI fields that this server does not apply are still checked (`NotApplied`), so that a value
OpenAI would refuse is refused here too, naming the field. Bodies are parsed here, not
by FastAPI, so that the ingress can check their size and the caller's key before any parsing.
Error bodies carry only what the client needs (field, reason, request id): `clean()` keeps
control characters, escapes and unencodable text out of them.
"""

import json
import re
import time
import typing

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.json_schema import models_json_schema

from fly_serve.params import ParamError, knobs


def _api_fields(group: str) -> dict:
    """Optional pydantic fields for the Params knobs of one API group (params.py is the one
    list of knobs): unset fields take the profile's defaults. A list knob also takes one item."""
    out = {}
    for f in knobs(group):
        tp = f.type
        if typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0] | tp
        out[f.name] = (tp | None, Field(None, description=f.metadata["help"]))
    return out


STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # NaN / Infinity: JSON allows them, no field means them
FlyOptions = create_model("FlyOptions", __config__=STRICT | ConfigDict(extra="forbid"), **_api_fields("fly"))
Sampling = create_model("Sampling", __config__=STRICT | ConfigDict(extra="ignore"), **_api_fields("openai"))


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class NotApplied(BaseModel):
    """OpenAI fields accepted and not applied (README, "Serving"): checked as OpenAI checks them;
    a value that would change the output (logprobs, logit_bias, echo, best_of > 1) is a 400
    naming the field rather than an answer that silently lacks it."""

    model_config = STRICT
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # not applied
    frequency_penalty: float | None = Field(None, ge=-2, le=2)  # not applied
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=20)

    def refuse_unsupported(self, logprobs) -> None:
        for name, value in (("logprobs", logprobs), ("logit_bias", self.logit_bias), ("echo", self.echo)):
            if value:
                raise ParamError(name, "not supported by this server")
        if self.best_of not in (None, 1):
            raise ParamError("best_of", "only best_of=1 is supported")


class RequestFields(Sampling, NotApplied):
    """What both request bodies carry besides the prompt."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    fly: FlyOptions | None = None

    def params(self) -> dict:
        """Engine params: only what the client set; the engine fills in its defaults."""
        if self.n != 1:
            raise ParamError("n", "only n=1 is supported")
        self.refuse_unsupported(getattr(self, "logprobs", None))
        own = {k: getattr(self, k) for k in Sampling.model_fields}
        fly = self.fly.model_dump(exclude_none=True) if self.fly else {}
        return {k: v for k, v in own.items() if v is not None} | fly

    def client_field(self, param: str | None) -> str | None:
        """An engine field (a ParamError's) as the client sent it: "fly.k" for a knob of `fly`."""
        if self.fly is not None and param in self.fly.model_fields_set:
            return f"fly.{param}"
        return param


class CompletionRequest(RequestFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompt_input(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ParamError("prompt", "a list of several prompts is not supported; send one")
            return self.prompt[0]
        return self.prompt


class Message(BaseModel):
    model_config = STRICT
    role: str
    content: str


class ChatRequest(RequestFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    def params(self) -> dict:
        p = super().params()
        if self.max_completion_tokens is not None:
            p.setdefault("max_tokens", self.max_completion_tokens)
        return p

    def client_field(self, param: str | None) -> str | None:
        if param == "prompt":
            return "messages"
        if param == "max_tokens" and self.max_tokens is None and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().client_field(param)


# every field name of the request bodies, to tell a field from a union member in an error's location
REQUEST_FIELDS = frozenset(
    name for m in (CompletionRequest, ChatRequest, FlyOptions, Message, StreamOptions) for name in m.model_fields
)


class BodyError(ValueError):
    """The body is not a request: not JSON, not an object, or a field of the wrong shape (400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request model of a raw body; BodyError names the first bad field ("fly.k",
    "messages.0.role") as OpenAI's `param`."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise BodyError(f"body: not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise BodyError("body: must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in field_path(first.get("loc", ()), first.get("type"))) or None
        raise BodyError(f"{param or 'body'}: {first.get('msg')}", param) from None


def field_path(loc: tuple, kind: str | None = None) -> tuple:
    """A pydantic error location as the client's field path: ("fly", "k", "int") names the
    union member that failed last; the client sent "fly.k". An unknown key (extra_forbidden) is
    the client's own name: kept ("fly.bogus")."""
    out = []
    for i, part in enumerate(loc):
        unknown_key = kind == "extra_forbidden" and i == len(loc) - 1
        if not (isinstance(part, int) or part in REQUEST_FIELDS or unknown_key):
            break
        out.append(part)
    return tuple(out)


def add_request_bodies(doc: dict, bodies: dict[str, type[BaseModel]]) -> None:
    """Declares, in an OpenAPI document, the JSON body of each POST path as its request model
    (the handlers parse bodies themselves, so FastAPI cannot see them): clients, generators and
    fuzzers then know what to send."""
    refs, defs = models_json_schema(
        [(m, "validation") for m in bodies.values()], ref_template="#/components/schemas/{model}"
    )
    doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in bodies.items():
        schema = refs[(model, "validation")]
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }


MESSAGE_CHARS = 500  # an error message longer than this is cut: it is for a person to read
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    """Text safe to put in a JSON error body: no terminal escapes or control characters, no lone
    surrogates (which would not encode), bounded length."""
    text = _CONTROL.sub("", _ANSI.sub("", text)).encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def error_body(
    message: str,
    param: str | None,
    kind: str = "invalid_request_error",
    code: str | None = None,
    request_id: str | None = None,
) -> dict:
    """OpenAI's error object, plus the id the client can quote to find the detail in the log."""
    err = {"message": clean(message), "type": kind, "param": param and clean(param), "code": code}
    if request_id is not None:
        err["request_id"] = request_id
    return {"error": err}


class ResponseBodies:
    """Builds the response bodies of one request (completion or chat) as updates come in."""

    def __init__(self, chat: bool, rid: str, model: str):
        self.chat, self.rid, self.model, self.created = chat, rid, model, int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(update) -> dict:
        return {
            "prompt_tokens": update.prompt_tokens,
            "completion_tokens": update.completion_tokens,
            "total_tokens": update.prompt_tokens + update.completion_tokens,
        }

    def full(self, text: str, last) -> dict:
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._head(self.object) | {"choices": [choice], "usage": self.usage(last), "fly": last.fly}

    def chunk(self, text: str | None, finish_reason=None, role: bool = False) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if role else {}) | ({"content": text} if text else {})
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice["text"] = text or ""
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, last) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": self.usage(last), "fly": last.fly}
