"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from max_n down to min_n). No model, a few microseconds.

`match_length` says how far that occurrence agrees with the sequence's end (its n tokens and the
ones before them): how long a proposal holds follows it (k_auto/lookup_match.py).

`propose` scans the whole sequence (numpy), O(context) a call. A row that comes as a
contracts.RowTokens with a key is answered by that key's `LookupIndex` instead: the latest end of
every n-gram of its committed tokens, grown as they grow, and a scan of the tokens after them
(its drafts), O(new tokens) a call, the same answer."""

from collections import OrderedDict

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens, k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens; fewer when the match lies near the end, none when nothing matches."""
    end = find(tokens, max_n, min_n) if k > 0 else None
    if end is None:
        return []
    out = tokens[end + 1 : end + 1 + k]
    return out.tolist() if hasattr(out, "tolist") else list(out)


def find(tokens, max_n: int = 4, min_n: int = 1) -> int | None:
    """The end of the latest earlier occurrence of the longest suffix of n tokens (max_n >= n >=
    min_n) that occurred before; None when none did."""
    if len(tokens) < 2:
        return None
    seq = np.asarray(tokens)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        # Windows over seq[:-1] start at 0 .. len-1-n: the suffix cannot match itself.
        windows = sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            return int(hits[-1]) + n - 1  # the latest occurrence: recent text repeats most
    return None


def match_length(tokens, end: int, cap: int) -> int:
    """How many tokens, at most cap, the sequence's end and the occurrence ending at `end` share,
    read backwards."""
    n, length = len(tokens), 0
    while length < cap and end - length >= 0 and tokens[end - length] == tokens[n - 1 - length]:
        length += 1
    return length


def _packed(ngram) -> int:
    """An n-gram as one int (token ids below 2**32): exact, so no collision to check."""
    key = 0
    for t in ngram:
        key = key << 32 | t
    return key


class LookupIndex:
    """One sequence's n-grams (n <= max_n) by the position of their latest end, for n-grams that
    end before its last `covered` - 1 tokens... precisely: every n-gram ending at a position e <=
    covered - 2 (one followed by a token inside the first `covered`)."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.last: list[dict[int, int]] = [{} for _ in range(max_n + 1)]  # last[n][packed n-gram] = e
        self.covered = 0
        self.check: int | None = None  # tokens[covered - 1] when indexed: a different sequence is caught

    def extend(self, tokens, upto: int) -> None:
        """Index tokens[:upto] (a prefix that only grows for this key)."""
        if upto <= self.covered:
            return
        lo = max(self.covered - 1, 0)
        window = tokens[max(lo - self.max_n + 1, 0) : upto]  # the tokens the new n-grams read
        off = max(lo - self.max_n + 1, 0)
        for e in range(lo, upto - 1):
            for n in range(1, min(self.max_n, e + 1) + 1):
                self.last[n][_packed(window[e - n + 1 - off : e + 1 - off])] = e
        self.covered, self.check = upto, tokens[upto - 1]

    def propose(self, tokens, k: int, max_n: int, min_n: int) -> list[int]:
        """prompt_lookup.propose(tokens, k, max_n, min_n), with tokens[:covered] indexed."""
        end = self.find(tokens, max_n, min_n) if k > 0 else None
        return [] if end is None else tokens[end + 1 : end + 1 + k]

    def find(self, tokens, max_n: int, min_n: int) -> int | None:
        """prompt_lookup.find(tokens, max_n, min_n), with tokens[:covered] indexed."""
        L = len(tokens)
        if L < 2:
            return None
        tail = tokens[max(self.covered - 1 - self.max_n, 0) :]  # what the scan reads (its drafts)
        off = L - len(tail)
        for n in range(min(max_n, self.max_n, L - 1), min_n - 1, -1):
            suffix = tail[len(tail) - n :]
            end = None
            for e in range(L - 2, max(self.covered - 1, n - 1) - 1, -1):  # newest first, past the index
                if tail[e - n + 1 - off : e + 1 - off] == suffix:
                    end = e
                    break
            if end is None:
                end = self.last[n].get(_packed(suffix))
            if end is not None:
                return end
        return None


class LookupIndexes:
    """A LookupIndex per row key, shared by every prompt lookup of an engine (its free drafts,
    the pld mode, the model drafter's MLA level); released with the row, and at most max_rows
    kept, least recently used out first: a drafter replica whose release of a row went astray
    (a pool that changed meanwhile) does not keep its index forever (a row dropped here is
    indexed again from its tokens on its next call)."""

    def __init__(self, max_n: int = 4, max_rows: int = 256):
        self.max_n, self.max_rows = max_n, max_rows
        self.by_key: OrderedDict[str, LookupIndex] = OrderedDict()

    def of(self, key: str, tokens, final: int) -> LookupIndex:
        """The key's index over its first `final` tokens (rebuilt if they are not the ones it saw)."""
        index = self.by_key.get(key)
        if index is None or final < index.covered or (index.covered and tokens[index.covered - 1] != index.check):
            index = self.by_key[key] = LookupIndex(self.max_n)
            while len(self.by_key) > self.max_rows:
                self.by_key.popitem(last=False)
        self.by_key.move_to_end(key)
        index.extend(tokens, final)
        return index

    def release(self, keys) -> None:
        for key in keys:
            self.by_key.pop(key, None)
