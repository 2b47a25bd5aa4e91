"""Rows that carry only what the receiver does not hold yet.

A row's tokens only grow (prompt, then committed tokens), so a part in another process that has
seen a row needs only the tokens since its last call: the sender (`RowSender`) sends
`tokens[start:]` with `Row.start`, the receiver (`RowHistory`) puts the row back together from
what it holds. A receiver that does not hold the first `start` tokens (a new or restarted
replica, a row moved to another drafter replica, a call that failed halfway) refuses the call
with `RowsUnknown`, and the sender sends those rows whole. What the parts then do with the full
rows is unchanged: the KV cache's content-addressed rule (kv_cache.py) stays the one rule, so a
row put back together is exactly the row that would have been sent whole. A constrained row's
grammar (Row.grammar) and a chat row's conversation (Row.chat) travel the same way: with the
row's whole tokens only, kept with them.
"""

from collections import OrderedDict
from dataclasses import replace

from fly_serve.contracts import Row, RowChat, RowGrammar


class RowsUnknown(LookupError):
    """Rows sent as a suffix whose start this receiver does not hold; send them whole."""

    def __init__(self, keys: list[str]):
        super().__init__(f"{len(keys)} rows not held here; send them whole")
        self.keys = keys


def rows_unknown(e: BaseException) -> bool:
    """Whether a failed call was a receiver's RowsUnknown, however Ray and Serve wrapped it."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RowsUnknown) or any(c.__name__ == "RowsUnknown" for c in type(e).__mro__):
            return True
        e = getattr(e, "cause", None) or e.__cause__
    return False


class RowHistory:
    """The receiver's side: every row's tokens so far, by key, at most `max_rows` (least
    recently used first out: a lost release costs a resend, never memory without end)."""

    def __init__(self, max_rows: int = 1024):
        self.max_rows = max_rows
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._grammars: dict[str, RowGrammar] = {}  # the constrained rows' grammars, as sent whole
        self._chats: dict[str, RowChat] = {}  # the chat rows' conversations, as sent whole

    def whole(self, rows: list[Row]) -> list[Row]:
        """The rows with all their tokens; raises RowsUnknown (holding nothing new) if any is
        a suffix of a history not held here."""
        unknown = [r.key for r in rows if r.start and len(self._tokens.get(r.key, ())) < r.start]
        if unknown:
            raise RowsUnknown(unknown)
        out = []
        for r in rows:
            # a held history longer than `start` (a retried call) is cut back: tokens only grow,
            # so its first `start` tokens are the sender's
            tokens = self._tokens[r.key][: r.start] + r.tokens if r.start else list(r.tokens)
            self._tokens[r.key] = tokens
            self._tokens.move_to_end(r.key)
            if not r.start:  # sent whole: its grammar and conversation (or none) came with it
                for held, value in ((self._grammars, r.grammar), (self._chats, r.chat)):
                    held.pop(r.key, None)
                    if value is not None:
                        held[r.key] = value
            grammar, chat = r.grammar or self._grammars.get(r.key), r.chat or self._chats.get(r.key)
            out.append(replace(r, tokens=tokens, start=0, grammar=grammar, chat=chat))
        while len(self._tokens) > self.max_rows:
            key = self._tokens.popitem(last=False)[0]
            self._grammars.pop(key, None)
            self._chats.pop(key, None)
        return out

    def release(self, keys: list[str]) -> None:
        for k in keys:
            self._tokens.pop(k, None)
            self._grammars.pop(k, None)
            self._chats.pop(k, None)


class RowSender:
    """The sender's side, one per receiver: how many tokens of each row it has sent. Only a call
    that succeeded counts (`sent`); a failed one, or a receiver that says it does not hold a row,
    makes the next call send the row whole (`forget`)."""

    def __init__(self):
        self._sent: dict[str, int] = {}

    def compact(self, rows: list[Row]) -> list[Row]:
        out = []
        for r in rows:
            start = self._sent.get(r.key, 0)
            if 0 < start <= len(r.tokens):  # without grammar and chat: the receiver holds them from the whole call
                r = replace(r, tokens=r.tokens[start:], start=start, grammar=None, chat=None)
            out.append(r)
        return out

    def sent(self, rows: list[Row]) -> None:
        """Rows of a call that succeeded; a draft-ahead row's guessed tail (Row.guessed) does not
        count: those tokens may never be committed, and the next call sends what replaced them."""
        for r in rows:
            self._sent[r.key] = len(r.tokens) - r.guessed

    def forget(self, keys: list[str]) -> None:
        for k in keys:
            self._sent.pop(k, None)
