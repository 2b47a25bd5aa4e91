"""OpenAI wire format: request bodies (pydantic), response / chunk bodies, error bodies.

Unknown top-level OpenAI fields are ignored (clients send many); the `fly` object is strict,
since a mistyped knob silently ignored would measure the wrong thing.
"""
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field


class FlyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str | None = None
    k: int | None = None
    theta: float | None = None
    window: int | None = None
    entropy: str | None = None
    window_rule: str | None = None
    mla: bool | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    fly: FlyOptions | None = None

    def params(self) -> dict:
        """Engine params: only what the client set; the engine fills in its defaults."""
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        own = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "stop", "seed")}
        fly = self.fly.model_dump(exclude_none=True) if self.fly else {}
        return {k: v for k, v in own.items() if v is not None} | fly


class CompletionRequest(Common):
    prompt: str | list[int] | list[str]

    def prompt_input(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: a list of several prompts is not supported; send one")
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


def field_of(error: ValueError) -> str | None:
    """The engine's ValueErrors read "field: why"."""
    head, sep, _ = str(error).partition(":")
    return head.strip() if sep and " " not in head.strip() else None


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
        return {"prompt_tokens": update.prompt_tokens, "completion_tokens": update.completion_tokens,
                "total_tokens": update.prompt_tokens + update.completion_tokens}

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
