"""OpenAI wire format: request bodies (pydantic), response / chunk bodies, error bodies.

Unknown top-level OpenAI fields are ignored (clients send many); the `fly` object is strict,
since a mistyped knob silently ignored would measure the wrong thing.
"""

import time
import typing
import uuid

from pydantic import BaseModel, ConfigDict, Field, create_model

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


FlyOptions = create_model("FlyOptions", __config__=ConfigDict(extra="forbid"), **_api_fields("fly"))
Sampling = create_model("Sampling", __config__=ConfigDict(extra="ignore"), **_api_fields("openai"))


class StreamOptions(BaseModel):
    include_usage: bool = False


class Common(Sampling):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    fly: FlyOptions | None = None

    def params(self) -> dict:
        """Engine params: only what the client set; the engine fills in its defaults."""
        if self.n != 1:
            raise ParamError("n", "only n=1 is supported")
        own = {k: getattr(self, k) for k in Sampling.model_fields}
        fly = self.fly.model_dump(exclude_none=True) if self.fly else {}
        return {k: v for k, v in own.items() if v is not None} | fly


class CompletionRequest(Common):
    prompt: str | list[int] | list[str]

    def prompt_input(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ParamError("prompt", "a list of several prompts is not supported; send one")
            return self.prompt[0]
        return self.prompt


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def params(self) -> dict:
        p = super().params()
        if self.max_completion_tokens is not None:
            p.setdefault("max_tokens", self.max_completion_tokens)
        return p


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Shape:
    """Builds response bodies of one request (completion or chat) as updates come in."""

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
