"""Text in: a chat turn rendered with the model's template, and a prompt turned into token ids
with a clear error for text that is not valid Unicode (a lone surrogate from JSON "\\ud800").

A raw completion starts with the tokenizer's BOS token where it defines one and adds it (Llama:
without <|begin_of_text|> the model sees text it was never trained to continue); Qwen defines none.
A chat prompt gets none here: the template renders its own (Llama's starts with {{ bos_token }})."""

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


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The conversation rendered with the model's chat template, ready for the reply. A template
    that refuses the conversation (roles that do not alternate, a role it does not know: its
    raise_exception) refuses the request's messages, naming them."""
    for i, m in enumerate(messages):
        check_text(m["content"], f"messages.{i}.content")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise ParamError("messages", f"the model's chat template refused them: {e}") from None


def chat_prompt(tokenizer, text: str) -> list[int]:
    """One user turn, as token ids."""
    return encode(tokenizer, chat_text(tokenizer, [{"role": "user", "content": text}]))
