"""Suffix index: a draft source over the tokens of EARLIER requests, shared by all rows of a
replica. Prompt lookup (pld.py) only sees the row's own tokens; agents, code edits and templated
answers also repeat what other requests produced, and this index finds that. No model.

Data structure: LZ77-style hash chains (the match finder of zlib), not a suffix tree.
  * tokens  a ring buffer of int32 holding the stored sequences back to back, each preceded by
            a separator (-1): matches and continuations stop at it, so no sequence bleeds into
            the next and no explicit sequence bounds need storing.
  * heads   per chain level n, a fixed hash table: bucket of an n-gram -> absolute position of
            the latest stored n-gram hashing there (int64, -1 empty).
  * links   per level, per ring slot: distance back to the previous position in the same bucket
            (int32, 0: none). Walking head -> links visits the occurrences newest first.
Why: a Python dict/trie of n-grams costs hundreds of bytes per stored token per n; these flat
arrays cost 4 + 4 * levels bytes per slot plus the fixed head tables, and eviction is free:
positions are absolute and monotone, so a chain walk simply stops at the first position older
than the oldest live sequence; nothing has to be unlinked.
Levels: chains keyed on n = max_n, max_n/2, ... down to min_n. A single chain on min_n-grams would
be capped (max_candidates) among the most recent occurrences of a common bigram and miss an
older long match; searching the longest level first finds a long match whenever it is among the
max_candidates newest entries of its own (much shorter) chain.

Choosing among occurrences: the candidates sharing the longest match vote on each next token in
turn; the most frequent wins (ties: the most recent occurrence), and only the candidates that
agree go on to vote for the following token. That is frequency-weighted like SuffixDecoding's
tree without building the tree.

Single-threaded by design: one engine thread calls add and propose; there are no locks, so
calls from several threads at once are not supported. Deterministic: fixed hash constants,
ties broken by recency.
"""

from collections import deque
from collections.abc import Sequence

import numpy as np

_SEP = -1  # never a token id: stops matches and continuations at sequence borders
_MULT = np.uint64(0x100000001B3)  # FNV-1a 64-bit prime: mixes each token into the hash
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads the high bits to buckets
_MASK = (1 << 64) - 1


def _levels(max_n: int, min_n: int) -> list[int]:
    """Chain keys n = max_n, max_n // 2, ..., always ending with min_n (longest first)."""
    levels, n = [], max_n
    while n > min_n:
        levels.append(n)
        n //= 2
    return levels + [min_n]


def _window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 hash of every window of n consecutive tokens (one per window end)."""
    tokens = tokens.astype(np.uint64)
    h = np.full(len(tokens) - n + 1, 0xCBF29CE484222325, dtype=np.uint64)
    for i in range(n):  # arrays wrap on overflow silently, which is the intended mod 2**64
        h = (h ^ tokens[i : len(tokens) - n + 1 + i]) * _MULT
    return h


def _buckets(hashes: np.ndarray, bits: int) -> np.ndarray:
    return ((hashes * _GOLDEN) >> np.uint64(64 - bits)).astype(np.int64)


def _bucket(ngram: list[int], bits: int) -> int:
    """_buckets(_window_hashes(ngram, len(ngram))) for one n-gram, in Python ints: numpy's
    per-call overhead dominates for a single window, and this runs on every propose."""
    h = 0xCBF29CE484222325
    for t in ngram:
        h = ((h ^ t) * int(_MULT)) & _MASK
    return ((h * int(_GOLDEN)) & _MASK) >> (64 - bits)


def _table_bits(max_tokens: int) -> int:
    # About one bucket per two slots: collisions only cost chain steps (every candidate is
    # verified against the tokens), and the head tables are the largest fixed cost.
    return max(8, int(max_tokens).bit_length() - 1)


class SuffixIndex:
    def __init__(self, max_tokens: int = 1_000_000, max_n: int = 8, min_n: int = 2, max_candidates: int = 64):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if max_tokens < min_n + 2:
            raise ValueError(f"max_tokens {max_tokens} too small")
        self.max_tokens, self.max_n, self.min_n = max_tokens, max_n, min_n
        # Chain steps per level per propose: bounds the latency of common n-grams.
        self.max_candidates = max_candidates
        self.levels = _levels(max_n, min_n)
        self.bits = _table_bits(max_tokens)
        self._cap = max_tokens  # ring slots; separators use slots too
        self._tokens: np.ndarray | None = None  # allocated on the first add
        self._links: np.ndarray | None = None
        self._heads: np.ndarray | None = None
        self._link_views: list[memoryview] = []
        self._seqs: deque[tuple[int, int]] = deque()  # (absolute start, slots), oldest first
        self._end = 0  # absolute position of the next free slot
        self._used = 0  # slots held by live sequences

    # ---- state -----------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Stored tokens, separators excluded (always <= max_tokens)."""
        return self._used - len(self._seqs)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (fixed once allocated, whatever is stored)."""
        arrays = (self._tokens, self._links, self._heads)
        return sum(a.nbytes for a in arrays if a is not None)

    def _live_start(self) -> int:
        return self._seqs[0][0] if self._seqs else self._end

    def _allocate(self):
        self._tokens = np.full(self._cap, _SEP, dtype=np.int32)
        self._links = np.zeros((len(self.levels), self._cap), dtype=np.int32)
        self._heads = np.full((len(self.levels), 1 << self.bits), -1, dtype=np.int64)
        self._link_views = [memoryview(row) for row in self._links]

    def clear(self):
        self._tokens = self._links = self._heads = None
        self._link_views = []
        self._seqs.clear()
        self._end = self._used = 0

    def snapshot(self) -> dict:
        """A copy of what the index has learned, for restore (a benchmark compares drafters
        from the same history; a replica could persist it)."""
        arrays = {name: getattr(self, name) for name in ("_tokens", "_links", "_heads")}
        state = {name: None if a is None else a.copy() for name, a in arrays.items()}
        return state | {"_seqs": list(self._seqs), "_end": self._end, "_used": self._used}

    def restore(self, state: dict):
        """Back to a snapshot of an index with the same bounds (later adds are forgotten)."""
        for name in ("_tokens", "_links", "_heads"):
            setattr(self, name, None if state[name] is None else state[name].copy())
        self._link_views = [] if self._links is None else [memoryview(row) for row in self._links]
        self._seqs = deque(state["_seqs"])
        self._end, self._used = state["_end"], state["_used"]

    # ---- learning --------------------------------------------------------------------------

    def add(self, tokens: Sequence[int]):
        """Store a finished request's tokens (its output; its prompt too if the caller wants
        prompts matched). Evicts the oldest sequences until it fits."""
        seq = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if seq.size and seq.min() < 0:
            raise ValueError("token ids must be >= 0")
        seq = seq[-(self._cap - 1) :]  # a sequence longer than the ring keeps its recent end
        if seq.size < self.min_n + 1:
            return  # no n-gram with a continuation to offer
        if self._tokens is None:
            self._allocate()
        slots = seq.size + 1
        while self._used + slots > self._cap:
            _, old = self._seqs.popleft()
            self._used -= old
        start = self._end
        positions = np.arange(start, start + slots)
        self._tokens[positions % self._cap] = np.concatenate(([_SEP], seq)).astype(np.int32)
        for level, n in enumerate(self.levels):
            self._link(level, n, seq, start + 1)
        self._seqs.append((start, slots))
        self._used += slots
        self._end += slots

    def _link(self, level: int, n: int, seq: np.ndarray, first: int):
        """Push each n-gram of seq (but the one ending on its last token, which has nothing to
        continue with) onto its bucket's chain. Vectorised: a stable sort by bucket gives each
        position its predecessor within this sequence; the first of a bucket links to the
        old head."""
        if seq.size - 1 < n:
            return
        buckets = _buckets(_window_hashes(seq[:-1], n), self.bits)
        pos = first + n - 1 + np.arange(buckets.size)  # absolute position of each n-gram's end
        order = np.argsort(buckets, kind="stable")
        b, p = buckets[order], pos[order]
        same = np.zeros(b.size, dtype=bool)
        same[1:] = b[1:] == b[:-1]
        prev = np.where(same, np.roll(p, 1), self._heads[level, b])
        dist = p - prev
        # No predecessor, or one so far back it has left the ring anyway: end of chain.
        dist[(prev < 0) | (dist >= self._cap)] = 0
        self._links[level, p % self._cap] = dist.astype(np.int32)
        last = np.ones(b.size, dtype=bool)
        last[:-1] = b[1:] != b[:-1]
        self._heads[level, b[last]] = p[last]

    # ---- drafting --------------------------------------------------------------------------

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens continuing `tokens`, from the longest suffix (max_n .. min_n tokens)
        found in the stored sequences; [] when nothing matches."""
        if k <= 0 or self._tokens is None or len(tokens) < self.min_n:
            return []
        tail = np.asarray(tokens[-self.max_n :], dtype=np.int64).reshape(-1)
        matches = self._longest_matches(tail)
        if matches.size == 0:
            return []
        return self._vote(self._continuations(matches, k))

    def _chain(self, level: int, tail: np.ndarray, n: int) -> np.ndarray:
        """Positions (newest first) in the bucket of tail's last n tokens, at most
        max_candidates; some may be hash collisions, the caller verifies."""
        live, cap = self._live_start(), self._cap
        links = self._link_views[level]  # memoryview: indexing yields Python ints, no boxing
        out = []
        p = int(self._heads[level, _bucket(tail[-n:].tolist(), self.bits)])
        while p >= live and len(out) < self.max_candidates:
            out.append(p)
            d = int(links[p % cap])
            if d == 0:
                break
            p -= d
        return np.asarray(out, dtype=np.int64)

    def _match_lengths(self, ends: np.ndarray, tail: np.ndarray) -> np.ndarray:
        """How many tokens before each end position (inclusive) equal the tail's last ones.
        Slots read beyond a match's separator may hold newer data, but the cumulative product
        has already stopped at the separator."""
        back = ends[:, None] - np.arange(tail.size)
        equal = self._tokens[back % self._cap] == tail[::-1]
        return np.cumprod(equal, axis=1).sum(axis=1)

    def _longest_matches(self, tail: np.ndarray) -> np.ndarray:
        """End positions of the occurrences sharing the longest verified match (>= min_n),
        newest first; empty when no level finds one."""
        for level, n in enumerate(self.levels):
            if n > tail.size:
                continue
            ends = self._chain(level, tail, n)
            if ends.size == 0:
                continue
            lengths = self._match_lengths(ends, tail)
            best = lengths.max()
            if best >= n:  # below n every candidate was a hash collision
                return ends[lengths == best]
        return np.empty(0, dtype=np.int64)

    def _continuations(self, ends: np.ndarray, k: int) -> np.ndarray:
        """[candidates, k] tokens following each end, -1 from the first separator or the end
        of storage onwards."""
        pos = ends[:, None] + 1 + np.arange(k)
        follow = np.where(pos < self._end, self._tokens[pos % self._cap], _SEP)
        follow[np.cumsum(follow == _SEP, axis=1) > 0] = _SEP
        return follow

    @staticmethod
    def _vote(follow: np.ndarray) -> list[int]:
        """Walk the candidates' continuations: at each step the most frequent next token among
        those that agreed so far; a tie goes to the newest (rows are newest first). Plain Python:
        a few dozen short rows are cheaper as lists than as numpy calls."""
        out: list[int] = []
        rows = follow.tolist()
        for j in range(follow.shape[1]):
            counts: dict[int, int] = {}
            for row in rows:
                if row[j] != _SEP:
                    counts[row[j]] = counts.get(row[j], 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # first maximum in insertion order
            out.append(token)
            rows = [row for row in rows if row[j] == token]
        return out
