"""Text in: a chat turn rendered with the model's template, and a prompt turned into token ids
with a clear error for text that is not valid Unicode (a lone surrogate from JSON "\\ud800").

A raw completion starts with the tokenizer's BOS token where it defines one and adds it (Llama:
without <|begin_of_text|> the model sees text it was never trained to continue); Qwen defines none.
A chat prompt gets none here: the template renders its own (Llama's starts with {{ bos_token }})."""

import json

import jinja2

from .params import ParamError


def check_text(text: str, field: str = "prompt") -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(field, f"not valid Unicode text ({e.reason} at character {e.start})") from None
    return text


def bos_ids(tokenizer) -> list[int]:
    """[BOS] if the tokenizer defines a BOS token and its own encoding adds it, else []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    return [bos] if tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else []


def encode(tokenizer, text: str, field: str = "prompt", bos: bool = False) -> list[int]:
    """Token ids of `text`, no special tokens added, BOS first when `bos` (a raw completion) and
    the tokenizer adds one (bos_ids)."""
    if not text:
        return []
    ids = tokenizer.encode(check_text(text, field), add_special_tokens=False)
    return bos_ids(tokenizer) + ids if bos else ids


def completion_prompt(tokenizer, text: str, field: str = "prompt") -> list[int]:
    """A raw completion's token ids: BOS where the model expects one, then the text."""
    return encode(tokenizer, text, field, bos=True)


# OpenAI's roles (a chat template names the ones it shows) and what a role the template does not
# name is shown as: developer messages are system messages for models without a developer role
# (OpenAI: they replace system messages on its newer models), a function message is the deprecated
# form of a tool's result.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
STANDS_FOR = {"developer": "system", "function": "tool"}


def _template_source(tokenizer) -> str:
    source = tokenizer.chat_template or ""
    return "\n".join(source.values()) if isinstance(source, dict) else source


def _named_roles(source: str) -> set[str]:
    """The roles a chat template names (as a quoted string). One that names none shows every
    message under its own role (as the tiny models' template does)."""
    return {r for r in ROLES if f"'{r}'" in source or f'"{r}"' in source}


def template_messages(tokenizer, messages: list[dict]) -> list[dict]:
    """The messages as the model's chat template reads them: developer and function messages
    shown as the role they stand for (STANDS_FOR) unless the template names their own, and tool
    calls' JSON arguments as objects (what templates expect: they write them out with `tojson`).
    A message the template would leave out (a role it has no turn for, tool calls it does not
    show) is refused, naming it: never dropped from the prompt silently. Text is checked to be
    valid Unicode."""
    source = _template_source(tokenizer)
    named = _named_roles(source)
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("content") is not None:
            check_text(m["content"], f"messages.{i}.content")
        role = m["role"]
        if role in STANDS_FOR and role not in named:
            role = STANDS_FOR[role]
        if named and role not in named:
            raise ParamError(f"messages.{i}.role", f"the model's chat template has no {m['role']!r} turns")
        m["role"] = role
        if m.get("tool_calls"):
            if "tool_calls" not in source:
                raise ParamError(f"messages.{i}.tool_calls", "the model's chat template does not show tool calls")
            calls = enumerate(m["tool_calls"])
            m["tool_calls"] = [_call_for_template(c, f"messages.{i}.tool_calls.{j}") for j, c in calls]
        out.append(m)
    return out


def _call_for_template(call: dict, at: str) -> dict:
    function = dict(call["function"])
    check_text(function["name"], f"{at}.function.name")
    check_text(function["arguments"], f"{at}.function.arguments")
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:  # not JSON: shown as the text the model wrote
        arguments = function["arguments"]
    return {**call, "function": {**function, "arguments": arguments}}


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The conversation rendered with the model's chat template, ready for the reply (messages:
    role, content text or None beside tool calls, and OpenAI's tool_calls / tool_call_id; see
    template_messages). A template that refuses the conversation (roles that do not alternate:
    its raise_exception), or fails on it, refuses the request's messages, naming them."""
    shown = template_messages(tokenizer, messages)
    try:
        return tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise ParamError("messages", f"the model's chat template refused them: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a template reading a shape it does not expect
        why = f"{type(e).__name__}: {e}"
        raise ParamError("messages", f"the model's chat template cannot render them ({why})") from None


def chat_prompt(tokenizer, text: str) -> list[int]:
    """One user turn, as token ids."""
    return encode(tokenizer, chat_text(tokenizer, [{"role": "user", "content": text}]))
