"""A request's prompt as token ids, off the event loop and off the engine thread."""

from fly_serve.engine.params import ParamError
from fly_serve.engine.prompts import chat_text, encode
from fly_serve.loading.loading import load_tokenizer

# A prompt's length in characters proves it too long for the context only beyond this many
# characters per token: the longest token's text times a margin for normalizers that compose
# characters (NFC turns up to 3 into 1), so the check never rejects a prompt that would fit.
NORMALIZE_MARGIN = 4


def max_token_chars(tokenizer) -> int:
    """At least the characters any one token stands for: the longest token string of the
    vocabulary, added tokens included (byte-level BPE writes a character per byte, and a
    character is at least a byte; SentencePiece writes its pieces as they read)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class PromptEncoder:
    """Handlers tokenize in worker threads on a tokenizer instance of their own, never the
    engine's (a tokenizer is not safe to share across threads)."""

    def __init__(self, model: str, max_model_len: int):
        self.tokenizer = load_tokenizer(model)
        self.max_model_len = max_model_len
        self.max_chars = NORMALIZE_MARGIN * max_token_chars(self.tokenizer) * max_model_len

    def prompt_ids(self, body, chat: bool) -> list[int]:
        """The prompt's token ids (call in a worker thread: a long prompt holds up neither the
        event loop nor the engine thread). A prompt whose length alone proves it past the
        context is refused without tokenizing it."""
        if chat:
            text = chat_text(self.tokenizer, [m.for_template() for m in body.messages])
        else:
            text = body.prompt_input()
            if not isinstance(text, str):
                return text  # token ids: the engine checks their range
        if len(text) > self.max_chars:
            raise ParamError("prompt", f"longer than the context window of {self.max_model_len} tokens")
        return encode(self.tokenizer, text, bos=not chat)  # a chat template writes its own BOS
