"""OpenAI wire format: request bodies (pydantic), response / chunk bodies, error bodies.

Unknown top-level fields are ignored (clients send many); the `fly` object is strict, since a
mistyped knob silently ignored would measure the wrong thing. Every field is parsed strictly, as
OpenAI's API does: a number is a JSON number (not "0.5", not true), an integer has no fraction.
OpenAI fields that this server does not apply are still checked (`NotApplied`), so that a value
OpenAI would refuse is refused here too, naming the field; and a field that would change the
output (OpenAI's or vLLM's: top_k, tools, suffix ...) is a 400 naming it unless its value is the
neutral one (`UNAPPLIED`), as vLLM answers for what it does not support. Bodies are parsed here, not
by FastAPI, so that the ingress can check their size and the caller's key before any parsing.
Error bodies carry only what the client needs (field, reason, request id): `clean()` keeps
control characters, escapes and unencodable text out of them.
"""

import json
import re
import time
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.json_schema import models_json_schema

from fly_serve.engine.params import ParamError, knobs


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
    """OpenAI fields accepted and checked as OpenAI checks them, and not applied: a value that
    would change the output is refused by `refuse_unapplied` (UNAPPLIED), naming the field,
    rather than answered without it."""

    model_config = STRICT
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=20)


NOT_SUPPORTED = "not supported by this server"
STRUCTURED = "not supported here; use response_format, fly.regex or fly.grammar"
# Fields (OpenAI's, and vLLM's extras) that change the output and that this server does not
# apply, each with its neutral values (absent, null or one of these: accepted) and why any other
# value is refused. Fields that change nothing of the output (user, service_tier ...) stay ignored.
UNAPPLIED: dict[str, tuple[tuple, str]] = {
    "logprobs": ((False, 0), NOT_SUPPORTED),
    "top_logprobs": ((), "needs logprobs, which this server does not support"),
    "logit_bias": (({},), NOT_SUPPORTED),
    "echo": ((False,), NOT_SUPPORTED),
    "best_of": ((1,), "only best_of=1 is supported"),
    "presence_penalty": ((0,), "not supported by this server (only 0)"),
    "frequency_penalty": ((0,), "not supported by this server (only 0)"),
    "repetition_penalty": ((1,), "not supported by this server (only 1)"),
    "top_k": ((-1, 0), "not supported by this server (only -1 or 0: no top-k cut)"),
    "min_p": ((0,), "not supported by this server (only 0)"),
    "suffix": (("",), NOT_SUPPORTED),
    "functions": (([],), "function calling is not supported by this server"),
    "function_call": (("none", "auto"), "function calling is not supported by this server"),
    "regex": ((), "a field of the `fly` object here: send it as fly.regex"),
    "grammar": ((), "a field of the `fly` object here: send it as fly.grammar"),
    "guided_json": ((), STRUCTURED),
    "guided_regex": ((), STRUCTURED),
    "guided_choice": ((), STRUCTURED),
    "guided_grammar": ((), STRUCTURED),
    "structured_outputs": ((), STRUCTURED),
    "min_tokens": ((0,), NOT_SUPPORTED),
    "ignore_eos": ((False,), NOT_SUPPORTED),
    "stop_token_ids": (([],), NOT_SUPPORTED),
    "bad_words": (([],), NOT_SUPPORTED),
    "allowed_token_ids": ((), NOT_SUPPORTED),
    "prompt_logprobs": ((), NOT_SUPPORTED),
}
TOOLS = 'tool calling is not supported by this server (only tool_choice "none")'


def neutral(value, values: tuple) -> bool:
    """The value leaves the output as it is: null, or one of `values` (true is not 1, false not 0)."""
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)


def refuse_unapplied(obj: dict) -> None:
    """BodyError naming the first field that would change the output and is not applied here.
    Tools: with tool_choice "none" the model is not to call them, so they change nothing."""
    for name, (values, why) in UNAPPLIED.items():
        if not neutral(obj.get(name), values):
            raise BodyError(f"{name}: {why}", name)
    choice = obj.get("tool_choice")
    if obj.get("tools") and choice != "none":
        raise BodyError(f"tools: {TOOLS}", "tools" if choice in (None, "auto") else "tool_choice")
    if not neutral(choice, ("none", "auto")):
        raise BodyError(f"tool_choice: {TOOLS}", "tool_choice")


class RequestFields(Sampling, NotApplied):
    """What both request bodies carry besides the prompt."""

    model: str | None = None
    n: int | None = None  # null: 1, as OpenAI reads it
    stream: bool | None = None  # null: false
    stream_options: StreamOptions | None = None
    fly: FlyOptions | None = None

    def refuse(self) -> None:
        """BodyError for a request OpenAI refuses though each field is well formed."""
        if self.stream_options is not None and not self.stream:
            raise BodyError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
            )

    def params(self) -> dict:
        """Engine params: only what the client set; the engine fills in its defaults."""
        if self.n not in (None, 1):
            raise ParamError("n", "only n=1 is supported")
        own = {k: getattr(self, k) for k in Sampling.model_fields}
        fly = self.fly.model_dump(exclude_none=True) if self.fly else {}
        return {k: v for k, v in own.items() if v is not None} | fly

    def client_field(self, param: str | None) -> str | None:
        """An engine field (a ParamError's) as the client sent it: "fly.k" for a knob of `fly`."""
        if self.fly is not None and param in self.fly.model_fields_set:
            return f"fly.{param}"
        return param


class CompletionRequest(RequestFields):
    # OpenAI's four forms: text, token ids, and a batch of either (one prompt here: n = 1 per request)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids, unwrapped from a batch of one."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ParamError("prompt", "a batch of several prompts is not supported; send one per request")
            return self.prompt[0]
        return self.prompt


# The roles of OpenAI's chat messages (developer: the system role of its newer models; function:
# the deprecated form of a tool's result)
ROLES = Literal["system", "developer", "user", "assistant", "tool", "function"]
PARTS_OF = {"assistant": ("text", "refusal")}  # the content part types a role may send here; others: text
NOT_TEXT = "only text content parts are supported by this server"


class ContentPart(BaseModel):
    """A part of a message's content: "text" (its `text`), or an assistant's "refusal" (its
    `refusal`). Other types (image_url, input_audio, file) are refused by ChatRequest.refuse."""

    model_config = STRICT
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn (OpenAI's function tool calls)."""

    model_config = STRICT
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(BaseModel):
    model_config = STRICT
    role: ROLES
    # a string or text parts; null only for an assistant turn that made tool calls (or refused)
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name: OpenAI's, not shown to the model here
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant
    function_call: dict | None = None  # assistant, deprecated: refused (send tool_calls)

    def text(self) -> str:
        """The content as one text: its parts joined by newlines (as vLLM joins them); an
        assistant's refusal where it has no content."""
        if isinstance(self.content, list):
            return "\n".join(p.text if p.type == "text" else p.refusal for p in self.content)
        if self.content is None:
            return self.refusal or ""
        return self.content

    def for_template(self) -> dict:
        """The message as chat templates read it (prompts.chat_text)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
            if self.content is None:
                out["content"] = None
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "function" and self.name is not None:
            out["name"] = self.name
        return out

    def refuse(self, at: str) -> None:
        """BodyError for what OpenAI refuses of a message, or what this server would not show
        the model; `at`: its place, "messages.3"."""
        if self.function_call is not None:
            raise BodyError(
                f"{at}.function_call: deprecated and not supported here; send the call as tool_calls",
                f"{at}.function_call",
            )
        if self.content is None:
            if self.role != "assistant" or not (self.tool_calls or self.refusal is not None):
                raise BodyError(f"{at}.content: required (null only beside an assistant's tool_calls)", f"{at}.content")
        elif isinstance(self.content, list):
            if not self.content:
                raise BodyError(f"{at}.content: an array of content parts must not be empty", f"{at}.content")
            allowed = PARTS_OF.get(self.role, ("text",))
            for j, part in enumerate(self.content):
                where = f"{at}.content.{j}"
                if part.type not in allowed:
                    raise BodyError(
                        f"{where}.type: {part.type!r}: {NOT_TEXT} (here: {', '.join(allowed)})", f"{where}.type"
                    )
                if getattr(part, part.type) is None:
                    raise BodyError(f"{where}.{part.type}: required for a part of type {part.type!r}", where)
        if self.tool_calls is not None and self.role != "assistant":
            raise BodyError(f"{at}.tool_calls: only an assistant message carries tool calls", f"{at}.tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise BodyError(f"{at}.tool_call_id: required in a tool message", f"{at}.tool_call_id")
        if self.role == "function" and self.name is None:
            raise BodyError(f"{at}.name: required in a function message", f"{at}.name")


class ChatRequest(RequestFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    def refuse(self) -> None:
        super().refuse()
        for i, m in enumerate(self.messages):
            m.refuse(f"messages.{i}")

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
    name
    for m in (CompletionRequest, ChatRequest, FlyOptions, Message, StreamOptions, ContentPart, ToolCall, FunctionCall)
    for name in m.model_fields
)


class BodyError(ValueError):
    """The body is not a request: not JSON, not an object, or a field of the wrong shape (400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


# What the prompt of a completion may be, said when it is none of them (pydantic would name the
# last union member it tried, which tells the client nothing)
PROMPT_FORMS = "must be a string, a list of token ids, or a batch of one of either (one prompt per request)"


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request model of a raw body; BodyError names the first bad field ("fly.k",
    "messages.0.role") as OpenAI's `param`. JSON nested past Python's recursion limit (about a
    thousand levels, far beyond any request) is refused as such, not left to crash the handler."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise BodyError("body: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise BodyError(f"body: not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise BodyError("body: must be a JSON object")
    try:
        body = model.model_validate(obj)
    except RecursionError:
        raise BodyError("body: JSON nested too deeply") from None
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in field_path(first.get("loc", ()), first.get("type"))) or None
        reason = PROMPT_FORMS if param == "prompt" and first.get("type") != "missing" else first.get("msg")
        raise BodyError(f"{param or 'body'}: {reason}", param) from None
    refuse_unapplied(obj)
    body.refuse()
    return body


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
