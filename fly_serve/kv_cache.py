"""A paged KV cache with a memory budget, addressed by token content (vLLM's paging, our rule).

Layout per layer: a pool of fixed-size blocks, `[(n_blocks + 1) * block_size, kv_heads, head_dim]`
for keys and the same for values. Each sequence (a key, e.g. a request id) owns a list of blocks,
its block table: position p lives in pool row `blocks[p // block_size] * block_size + p % block_size`.
Blocks come from a free list as a sequence grows and go back when it shrinks past a block boundary
or is released, so memory follows the tokens actually held, not slots x longest sequence.

A sequence remembers which tokens it holds; `plan()` compares them with the sequence's tokens and
keeps only the common prefix. That one rule covers every case the engine meets: rejected drafts
roll back (they are not in the sequence any more), a sequence seen for the first time is
prefilled, a sequence that another replica advanced is caught up, and nothing already cached is
ever recomputed.

Block 0 is scratch: table entries past a sequence's blocks point at it, so the padding of a
right-padded batch writes there instead of into another sequence's blocks, and reads past a row's
end (hidden by the attention mask) see finite garbage. Positions past a row's valid length inside
its own last block hold garbage too, which the mask hides and the next write overwrites.
"""

import heapq
import os
from collections import OrderedDict

import torch

SCRATCH = 0  # the block that padding writes to; never owned by a sequence

# Every method that creates or changes a tensor runs in inference mode, as the forward does: the
# pool and the table are then inference tensors, which may only be changed in inference mode.


class KVCacheFull(RuntimeError):
    """A write needs more blocks than the budget has free (after evicting idle sequences).
    Raised before anything changed: every cached sequence, this one included, is as it was."""

    def __init__(self, key: str, needed: int, free: int):
        self.key, self.needed, self.free = key, needed, free
        super().__init__(f"KV cache full: {key!r} needs {needed} more blocks, {free} free")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a round appended tokens): one C-level compare
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def budget_from_device(fraction: float, device) -> int:
    """Bytes for a KV cache: `fraction` of the memory the device can still give.

    CUDA: the free memory reported by the driver (torch.cuda.mem_get_info), so call it after the
    weights are loaded. CPU: the *available* RAM (free plus reclaimable page cache, what the OS
    can hand out without swapping), from psutil when installed, else /proc/meminfo MemAvailable.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _available_ram()
    return int(free * fraction)


def _available_ram() -> int:
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCache:
    """Paged KV cache for one model (one tensor-parallel rank).

    Sizing: exactly one of budget_bytes (keys + values of every layer, the scratch block included)
    or budget_tokens (tokens held at once, all sequences together). initial_tokens: allocate that
    much and grow the pool (by doubling, copying it) up to the budget as needed; None allocates the
    whole budget now. max_seqs: keep at most this many sequences; past it the least recently used
    idle sequence is dropped (None: bounded by blocks only).

    Under tensor parallelism every rank must take the same decisions, so give all ranks the same
    budget_tokens (a byte budget from each rank's own free memory could differ).
    """

    @torch.inference_mode()
    def __init__(
        self,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device="cpu",
        budget_bytes: int | None = None,
        budget_tokens: int | None = None,
        block_size: int = 16,
        max_seqs: int | None = None,
        initial_tokens: int | None = None,
    ):
        if (budget_bytes is None) == (budget_tokens is None):
            raise ValueError("give exactly one of budget_bytes, budget_tokens")
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device, self.block_size, self.max_seqs = dtype, torch.device(device), block_size, max_seqs
        if budget_tokens is not None:
            self.n_blocks = budget_tokens // block_size
        else:
            self.n_blocks = budget_bytes // self.block_bytes - 1  # the scratch block is paid for too
        if self.n_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes or budget_tokens} holds no block of "
                f"{block_size} tokens ({self.block_bytes} bytes)"
            )
        self.k = [torch.empty((0, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty((0, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(n_layers)]
        self.allocated = 0  # blocks in the pool now (scratch not counted); grows up to n_blocks
        # A heap: the lowest free block first, so that a sequence growing alone, or starting in a
        # mostly free pool, gets consecutive blocks (then a forward reads them as a slice).
        self.free: list[int] = []
        self._grow(self.n_blocks if initial_tokens is None else min(self.n_blocks, cdiv(initial_tokens, block_size)))
        # Per sequence id: the tokens it holds and its blocks; keys map to ids, least recent first.
        self.seq_of: OrderedDict[str, int] = OrderedDict()
        self.tokens: list[list[int]] = []
        self.blocks: list[list[int]] = []
        self.free_seqs: list[int] = []
        # The block tables as one CPU tensor [sequences, blocks], SCRATCH past each one's blocks;
        # a forward takes its rows in one indexing op.
        self.table = torch.full((1, 1), SCRATCH, dtype=torch.long)

    # ---- sizes
    @property
    def block_bytes(self) -> int:
        """Bytes of one block: keys and values of every layer."""
        return 2 * self.n_layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def capacity_tokens(self) -> int:
        """Tokens the budget holds, all sequences together (allocated or not yet)."""
        return self.n_blocks * self.block_size

    def free_blocks(self) -> int:
        return len(self.free) + self.n_blocks - self.allocated

    def free_tokens(self) -> int:
        """Tokens that whole free blocks hold; room left in sequences' last blocks is not counted."""
        return self.free_blocks() * self.block_size

    def tokens_held(self, key: str) -> int:
        s = self.seq_of.get(key)
        return 0 if s is None else len(self.tokens[s])

    def blocks_held(self, key: str) -> int:
        s = self.seq_of.get(key)
        return 0 if s is None else len(self.blocks[s])

    # ---- the content rule
    def valid(self, key: str, tokens: list[int]) -> int:
        """How many of `tokens` the key's sequence already holds (0 for an unknown key)."""
        s = self.seq_of.get(key)
        return 0 if s is None else common_prefix(self.tokens[s], tokens)

    @torch.inference_mode()
    def plan(
        self, keys: list[str], tokens: list[list[int]], limits: list[int | None] | None = None, protect=()
    ) -> list[tuple[int, int]]:
        """[(seq, start)] per row: positions [0, start) of sequence `seq` are valid for the row's
        tokens; the caller feeds the rest and then calls wrote().

        At least the last token is always fed (its logits are what the caller wants), and never
        is `start` past the row's limit, for callers that need logits from a given position on.
        Each row ends up owning the blocks its tokens need. All or nothing: if the blocks do not
        fit even after evicting idle sequences (least recently used first; never one of `keys` or
        `protect`), raises KVCacheFull and changes nothing.
        """
        if len(set(keys)) != len(keys):
            raise ValueError(f"a key appears twice in one call: {keys}")
        if not all(tokens):
            raise ValueError("every row needs at least one token")
        limits = limits or [None] * len(keys)
        starts, deltas = [], []
        for key, toks, limit in zip(keys, tokens, limits):
            s = self.seq_of.get(key)
            start = min(self.valid(key, toks), len(toks) - 1)
            if limit is not None:
                start = min(start, limit)
            starts.append(start)
            # Blocks kept past `start` are overwritten, not freed and taken again.
            deltas.append(cdiv(len(toks), self.block_size) - (0 if s is None else len(self.blocks[s])))
        victims = self._victims(keys, deltas, set(keys) | set(protect))

        for key in victims:
            self._drop(key)
        plans = [(self._seq(key), start) for key, start in zip(keys, starts)]
        for (s, start), delta in zip(plans, deltas):  # shrink first: their blocks serve growth below
            self.tokens[s] = self.tokens[s][:start]
            if delta < 0:
                self._shrink(s, len(self.blocks[s]) + delta)
        for (s, _), delta in zip(plans, deltas):
            if delta > 0:
                self._extend(s, delta)
        if self.max_seqs is not None and len(self.seq_of) > self.max_seqs:
            idle = [k for k in self.seq_of if k not in keys and k not in protect]
            for key in idle[: max(0, len(self.seq_of) - self.max_seqs)]:
                self._drop(key)
        return plans

    def _victims(self, keys: list[str], deltas: list[int], busy: set) -> list[str]:
        """The idle keys to evict, least recently used first, so that every row's growth fits;
        raises KVCacheFull (naming the first row that does not fit) when even all of them would not do."""
        free = self.free_blocks() + sum(-d for d in deltas if d < 0)
        need = sum(d for d in deltas if d > 0)
        victims = []
        for key in self.seq_of:
            if free >= need:
                break
            if key not in busy:
                victims.append(key)
                free += len(self.blocks[self.seq_of[key]])
        if free < need:
            for key, d in zip(keys, deltas):
                if d > free:
                    raise KVCacheFull(key, d, free)
                free -= max(d, 0)
        return victims

    def wrote(self, seq: int, tokens: list[int]):
        """Record that `tokens` were written after the sequence's valid prefix."""
        self.tokens[seq] = self.tokens[seq] + list(tokens)
        assert len(self.tokens[seq]) <= len(self.blocks[seq]) * self.block_size

    @torch.inference_mode()
    def release(self, keys):
        for key in keys:
            self._drop(key)

    # ---- block tables for a forward
    @torch.inference_mode()
    def block_table(self, seqs: list[int], n_blocks: int) -> torch.Tensor:
        """LongTensor [B, n_blocks] of the rows' blocks (CPU), SCRATCH past each row's end."""
        if n_blocks > self.table.shape[1]:
            self._widen(n_blocks)
        return self.table[seqs, :n_blocks]

    def run_start(self, seq: int, n_blocks: int) -> int | None:
        """The first pool row of the sequence's first n_blocks blocks if they are consecutive in the
        pool (then its keys are a slice, no gather), else None."""
        b = self.blocks[seq]
        if len(b) < n_blocks or b[:n_blocks] != list(range(b[0], b[0] + n_blocks)):
            return None
        return b[0] * self.block_size

    # ---- bookkeeping
    def _seq(self, key: str) -> int:
        """The key's sequence id, made most recently used; a new key takes a free id."""
        if key in self.seq_of:
            self.seq_of.move_to_end(key)
            return self.seq_of[key]
        if self.free_seqs:
            s = self.free_seqs.pop()
        else:
            s = len(self.tokens)
            self.tokens.append([])
            self.blocks.append([])
            if s >= self.table.shape[0]:
                pad = torch.full((self.table.shape[0], self.table.shape[1]), SCRATCH, dtype=torch.long)
                self.table = torch.cat([self.table, pad])
        self.seq_of[key] = s
        return s

    def _drop(self, key: str):
        s = self.seq_of.pop(key, None)
        if s is not None:
            self._shrink(s, 0)
            self.tokens[s] = []
            self.free_seqs.append(s)

    def _shrink(self, seq: int, n: int):
        gone = self.blocks[seq][n:]
        self.blocks[seq] = self.blocks[seq][:n]
        self.table[seq, n : n + len(gone)] = SCRATCH
        for b in gone:
            heapq.heappush(self.free, b)

    def _extend(self, seq: int, n: int):
        if n > len(self.free):
            self._grow(n - len(self.free))
        new = [heapq.heappop(self.free) for _ in range(n)]
        old = len(self.blocks[seq])
        self.blocks[seq] = self.blocks[seq] + new
        if old + n > self.table.shape[1]:
            self._widen(old + n)
        self.table[seq, old : old + n] = torch.tensor(new)

    def _widen(self, n_blocks: int):
        rows, width = self.table.shape
        pad = torch.full((rows, max(n_blocks, 2 * width) - width), SCRATCH, dtype=torch.long)
        self.table = torch.cat([self.table, pad], 1)

    def _grow(self, at_least: int):
        """Add blocks to the pool (at least `at_least`, within the budget), doubling so that
        growing to the budget copies the pool only a few times."""
        new = min(self.n_blocks, max(self.allocated + at_least, 2 * self.allocated))
        rows = (new + 1) * self.block_size  # + the scratch block
        for pool in (self.k, self.v):
            for i, old in enumerate(pool):  # one layer at a time: the peak is one layer's copy
                # Zeros, not empty: masked values are still multiplied by 0, and 0 * NaN is NaN.
                pool[i] = torch.zeros((rows, self.kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
                pool[i][: len(old)] = old
        for b in range(self.allocated + 1, new + 1):  # above every block in the heap: no sift
            heapq.heappush(self.free, b)
        self.allocated = new
