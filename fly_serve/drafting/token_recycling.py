"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure"): a draft source built from
what the target already computed. Every verification forward yields the target's top-k next
tokens at each position; normally all but the argmax are thrown away. Here they fill an
adjacency table token -> its top_k likely successors, and a draft is a walk through the table.
No model, no extra forward.

Data structure: a dense int32 array [vocab_size, top_k], -1 = nothing recorded. Dense because
a lookup is one index with no hashing, and the bound is fixed and small (a 151,936-token vocab
with top_k 8 is 151,936 * 8 * 4 B = 4.9 MB); it is allocated on the first observe, so an engine
that never uses this source pays nothing. Each observe overwrites a token's row with the latest
top-k, as in the paper: the most recent context is the better guess.

Only a single chain (top-1 successors) is proposed; the other columns are kept so that a tree
proposal can be added without changing what is recorded.

Single-threaded by design (one engine thread calls observe and propose; no locks).
Deterministic: when a token occurs several times in one observe, its last occurrence wins.
"""

from collections.abc import Sequence

import numpy as np


def _as_numpy(x) -> np.ndarray:
    """Lists, numpy arrays and torch tensors (any device) as a numpy int64 array."""
    if hasattr(x, "detach"):  # torch without importing it: a GPU tensor syncs here
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def _last_occurrences(tokens: np.ndarray) -> np.ndarray:
    """Index of each distinct token's last occurrence: numpy leaves the winner of repeated
    indices in one fancy assignment unspecified, so duplicates are dropped first."""
    _, first_in_reversed = np.unique(tokens[::-1], return_index=True)
    return tokens.size - 1 - first_in_reversed


class TokenRecycling:
    def __init__(self, vocab_size: int, top_k: int = 8, max_tokens: int | None = None):
        if vocab_size <= 0 or top_k <= 0:
            raise ValueError(f"need vocab_size, top_k > 0, got {vocab_size}, {top_k}")
        self.vocab_size, self.top_k = vocab_size, top_k
        # Longest chain proposed, whatever k asks for (None: k alone bounds it). A chain
        # drifts further from the target's real continuation with every step.
        self.max_tokens = max_tokens
        self._table: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._table is None else self._table.nbytes

    def clear(self):
        self._table = None

    def snapshot(self) -> np.ndarray | None:
        """A copy of the table, for restore (a benchmark compares drafters from the same history)."""
        return None if self._table is None else self._table.copy()

    def restore(self, table: np.ndarray | None):
        self._table = None if table is None else table.copy()

    def observe(self, tokens, logits_topk_ids):
        """Record, for each input token, the target's top-k next-token ids at its position:
        tokens [T] (the tokens fed to the target), logits_topk_ids [T, >=1] (topk(...).indices of
        the logits at those positions, best first). Extra columns beyond top_k are dropped,
        missing ones stay -1."""
        tokens = _as_numpy(tokens).reshape(-1)
        ids = _as_numpy(logits_topk_ids).reshape(tokens.size, -1)[:, : self.top_k]
        if tokens.size == 0:
            return
        V = self.vocab_size
        # The checks read these few ids (a round's verified positions) as Python ints: each numpy
        # reduction took 10-25 us on the caches a forward has just swept (~0.1 ms a plain step).
        seen, flat = tokens.tolist(), ids.ravel().tolist()
        if not (0 <= min(flat) and max(flat) < V and 0 <= min(seen) and max(seen) < V):
            # Out-of-vocab inputs (padding, ids of a wider logits head) have no row to write.
            ids = np.where((ids >= 0) & (ids < V), ids, -1)
            keep = (tokens >= 0) & (tokens < V)
            tokens, ids = tokens[keep], ids[keep]
            if tokens.size == 0:
                return
            seen = tokens.tolist()
        if self._table is None:
            self._table = np.full((self.vocab_size, self.top_k), -1, dtype=np.int32)
        if len(set(seen)) < len(seen):  # a repeated token: its last occurrence wins
            last = _last_occurrences(tokens)
            tokens, ids = tokens[last], ids[last]
        if ids.shape[1] == self.top_k:
            self._table[tokens] = ids
        else:
            row = np.full((tokens.size, self.top_k), -1, dtype=np.int32)
            row[:, : ids.shape[1]] = ids
            self._table[tokens] = row

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Follow the top-1 successors from the last token, up to k (and max_tokens) steps.
        Repetition is allowed: a cycle is just a repeated phrase, and k caps its length."""
        limit = k if self.max_tokens is None else min(k, self.max_tokens)
        if limit <= 0 or self._table is None or len(tokens) == 0:
            return []
        token = int(tokens[-1])
        out: list[int] = []
        while len(out) < limit and 0 <= token < self.vocab_size:
            token = int(self._table[token, 0])
            if token < 0:
                break
            out.append(token)
        return out
