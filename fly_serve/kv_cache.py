"""A KV cache of fixed slots, one slot per running sequence, addressed by token content.

Layout per layer: [slots, capacity, kv_heads, head_dim]. A slot remembers which tokens it holds;
`plan()` compares them with the sequence's tokens and keeps only the common prefix. That one
rule covers every case the engine meets: rejected drafts roll back (they are not in the
sequence any more), a sequence seen for the first time is prefilled, a sequence that another
replica advanced is caught up, and nothing already cached is ever recomputed.
Slots past a row's valid length hold garbage that the attention mask hides and the next write
overwrites.
"""
from collections import OrderedDict

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a round appended tokens): one C-level compare
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class KVCache:
    def __init__(self, n_layers, n_slots, kv_heads, head_dim, dtype, capacity=256, device="cpu"):
        self.n_slots, self.kv_heads, self.head_dim, self.dtype = n_slots, kv_heads, head_dim, dtype
        shape = (n_slots, capacity, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]  # what each slot holds
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recent first

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def ensure_capacity(self, length: int):
        if length <= self.capacity:
            return
        new = max(length, 2 * self.capacity)
        pad = (0, 0, 0, 0, 0, new - self.capacity)
        self.k = [torch.nn.functional.pad(t, pad) for t in self.k]
        self.v = [torch.nn.functional.pad(t, pad) for t in self.v]

    def slot(self, key: str) -> int:
        """The key's slot; a new key takes a free slot or evicts the least recently used."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return self.slot_of[key]
        used = set(self.slot_of.values())
        free = [s for s in range(self.n_slots) if s not in used]
        if free:
            s = free[0]
        else:
            _, s = self.slot_of.popitem(last=False)
        self.tokens[s] = []
        self.slot_of[key] = s
        return s

    def plan(self, key: str, tokens: list[int], limit: int | None = None) -> tuple[int, int]:
        """(slot, start): positions [0, start) of the slot are valid for `tokens`; feed the rest.

        At least the last token is always fed (its logits are what the caller wants), and
        never is `start` past `limit`, for callers that need logits from a given position on.
        """
        s = self.slot(key)
        start = min(common_prefix(self.tokens[s], tokens), len(tokens) - 1)
        if limit is not None:
            start = min(start, limit)
        self.tokens[s] = self.tokens[s][:start]
        return s, start

    def valid(self, key: str, tokens: list[int]) -> int:
        """How many of `tokens` the key's slot already holds (0 for an unknown key)."""
        s = self.slot_of.get(key)
        return 0 if s is None else common_prefix(self.tokens[s], tokens)

    def wrote(self, slot: int, tokens: list[int]):
        """Record that `tokens` were written after the slot's valid prefix."""
        self.tokens[slot] = self.tokens[slot] + list(tokens)

    def release(self, keys):
        for key in keys:
            s = self.slot_of.pop(key, None)
            if s is not None:
                self.tokens[s] = []
