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

import functools

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
    stream holds them back until the next round tells. O(len(s)) per stop string s (it runs on the
    engine thread for every streamed request every round), where trying every prefix would cost
    O(len(s)^2)."""
    return max((_open_prefix(text, s) for s in dict.fromkeys(stops)), default=0)


def _open_prefix(text: str, stop: str) -> int:
    """The longest n < len(stop) such that text ends with stop[:n]: the stop string's matcher
    (Knuth-Morris-Pratt) run over the last len(stop) - 1 characters, from the first one that could
    begin it."""
    start = text.find(stop[0], max(0, len(text) - len(stop) + 1)) if stop else -1
    if start < 0:
        return 0
    border, n = _borders(stop), 0
    for c in text[start:]:
        if n == len(stop):  # a whole match (find_stop cuts there): go on from its longest border
            n = border[n - 1]
        while n and stop[n] != c:
            n = border[n - 1]
        if stop[n] == c:
            n += 1
    return border[n - 1] if n == len(stop) else n


@functools.lru_cache(maxsize=1024)
def _borders(stop: str) -> tuple[int, ...]:
    """KMP's failure function: for each prefix stop[:i + 1], the length of its longest proper
    prefix that is also its suffix. Cached: a request's few stop strings meet it every round."""
    border, n = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while n and stop[i] != stop[n]:
            n = border[n - 1]
        if stop[i] == stop[n]:
            n += 1
        border[i] = n
    return tuple(border)
