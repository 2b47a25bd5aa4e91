"""Text in: a chat turn rendered with the model's template, and a prompt turned into token ids
with a clear error for text that is not valid Unicode (a lone surrogate from JSON "\\ud800")."""

from .params import ParamError


def check_text(text: str, field: str = "prompt") -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(field, f"not valid Unicode text ({e.reason} at character {e.start})") from None
    return text


def encode(tokenizer, text: str, field: str = "prompt") -> list[int]:
    return tokenizer.encode(check_text(text, field), add_special_tokens=False) if text else []


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The conversation rendered with the model's chat template, ready for the reply."""
    for i, m in enumerate(messages):
        check_text(m["content"], f"messages.{i}.content")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_prompt(tokenizer, text: str) -> list[int]:
    """One user turn, as token ids."""
    return encode(tokenizer, chat_text(tokenizer, [{"role": "user", "content": text}]))
