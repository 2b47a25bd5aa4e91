"""Text out, O(new tokens) a round: an incremental detokenizer and stop-string matching over the
new text only.

Decoding the whole output every round (and searching all of it for stops) costs O(n) per round,
O(n^2) per request, on the one engine thread that serves every request. Instead each round
decodes a short window: the tokens since `prefix` (a few already-emitted tokens, for the context a
tokenizer needs to place spaces and merge byte pieces) with and without the new ones, and keeps
the difference. A window that ends inside a UTF-8 character (it decodes to U+FFFD at its end) is
held back until the character completes; at the end of the request what is left is flushed as the
whole decode would show it. The concatenation equals `decode(all, skip_special_tokens=True)`
(tests/test_detokenizer.py checks it on the real tokenizer and random ids).
"""

REPLACEMENT = "\ufffd"  # what a tokenizer shows for an incomplete UTF-8 sequence


def decoder(tokenizer):
    """ids -> text as tokenizer.decode(ids, skip_special_tokens=True) gives it. A fast tokenizer
    that cleans up no spaces decodes with its Rust backend directly: the same call without
    transformers' per-call conversions, which cost more than the decode of a few tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    """The growing text of one sequence's output tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = decoder(tokenizer)
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already; they give the next window its context
        self.read = 0  # ids[:read] are in the text

    def add(self, new: list[int]) -> str:
        """The text that `new` adds; empty while it ends inside a character."""
        self.ids.extend(new)
        return self._advance(flush=False)

    def flush(self) -> str:
        """Whatever is held back, as the full decode shows it (the request has ended)."""
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if not flush and (after.endswith(REPLACEMENT) or len(after) <= len(before)):
            return ""  # mid-character, or tokens with no text yet (special tokens)
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


def find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """The earliest position of any stop string in `text`, looking only where one could end past
    `searched` (text[:searched] was searched before and held none)."""
    cuts = []
    for s in stops:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0:
            cuts.append(i)
    return min(cuts) if cuts else None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may still become the start of a stop string: a
    stream holds them back until the next round tells."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
