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

Prefix cache (prefix_cache=True: vLLM's automatic prefix caching, under the same rule). A full
block is registered under the hash of every token from position 0 to its end (chained: the hash
of the block before it and its own tokens); its keys and values are a function of those tokens
alone (causal attention, rotary by absolute position, and a prefix always sits at the same
positions). plan() lets a row adopt its leading full blocks from the registry instead of feeding
them (reference-counted), never the block of its last token nor one past its limit: the forward
needs at least one fed token for logits. A write never goes into a block another sequence holds
(copy-on-write: a fresh block, the valid head copied when the write starts mid-block), and a
registered block written into leaves the registry first. The registered blocks of a released
or evicted sequence stay cached while no sequence holds them, evictable least recently used
first when a new block needs their room (free_blocks() counts them as free); blocks a rollback
drops (rejected drafts, rarely asked for again) are freed. Off (the default), nothing is
registered or adopted: every refcount is 1.

The parts: BlockPool counts blocks (free, held by how many sequences, registered under a prefix
hash, cached and evictable), a SeqRecord is one sequence's tokens, blocks and hashes, and KVCache
holds the tensors and the block tables and applies an update. An update is worked out whole
before anything changes (_Edit), and whatever can fail (a block the budget lacks, memory for a
larger pool or table) fails before the first change: the rest only moves counts and indices.

Block 0 is scratch: table entries past a sequence's blocks point at it, so the padding of a
right-padded batch writes there instead of into another sequence's blocks, and reads past a row's
end (hidden by the attention mask) see finite garbage. Positions past a row's valid length inside
its own last block hold garbage too, which the mask hides and the next write overwrites.
"""

import hashlib
import heapq
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

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


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """How many leading tokens a and b share, given that the first `start` are equal."""
    n = min(len(a), len(b))
    if start >= n:
        return n
    if a[start:n] == b[start:n]:  # the usual case (a round appended tokens): one C-level compare
        return n
    i = start
    while a[i] == b[i]:
        i += 1
    return i


def final_of(tokens) -> int:
    """The leading tokens a caller declares committed for its key (contracts.RowTokens.final)."""
    return getattr(tokens, "final", 0)


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


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The registry key of a full block: chained from the block before it (b"" for the first),
    so it stands for every token from position 0 to the block's end. blake2b, not hash(): the
    same in every process (every TP rank must decide alike), and 128 bits rule out collisions."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class _Edit:
    """What plan() will do to one row, worked out before anything changes (all or nothing). Only
    the row's blocks from `lo` on change: the work is O(new tokens), whatever the context."""

    start: int  # positions [0, start) are valid after the plan
    lo: int  # the row's first `lo` blocks stay as they are
    tail: list[int]  # its blocks from lo on after the plan; FRESH: one to take
    hashes: list[bytes]  # chained hashes of the full blocks it adopts (after its first `lo`)
    adopted: list[int] = field(default_factory=list)  # blocks taken from the registry (ref + 1)
    released: list[int] = field(default_factory=list)  # blocks it lets go of (ref - 1)
    written: list[int] = field(default_factory=list)  # own blocks it writes into (leave the registry)
    copy_from: int | None = None  # the first fresh block starts as a copy of this one (copy-on-write)
    held: int = 0  # the record's leading tokens equal to the row's before the plan (kept in place)

    @property
    def fresh(self) -> int:
        return self.tail.count(FRESH)

    @property
    def n_blocks(self) -> int:
        return self.lo + len(self.tail)


FRESH = -1  # in an _Edit's blocks: a block still to take


@dataclass
class SeqRecord:
    """One sequence's share of the cache: the tokens its blocks hold, its blocks (position p in
    blocks[p // block_size]) and the chained hashes of its leading full blocks."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    # Leading tokens known to be committed tokens of the key (a caller's RowTokens.final, up to
    # what the record held of them): a later row of the key is compared only past them.
    final: int = 0


class BlockPool:
    """Which blocks are where (vLLM v1's block pool): free (a heap, lowest first, so that a
    sequence gets consecutive blocks), held by `ref[b]` sequences, registered under a prefix hash
    (registry and hash_of), or cached and held by none (evictable, least recently released
    first). Counts only: the keys and values are KVCache's tensors. Block 0 (scratch) is never
    free. take() never allocates: KVCache grows the tensors and calls add() before an update."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks  # the budget
        self.allocated = 0  # blocks that exist now (scratch not counted)
        self.free: list[int] = []
        self.ref = [0]  # the scratch block's
        self.registry: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def free_blocks(self) -> int:
        """Blocks a new block can come from: free, not yet allocated, or cached but held by none."""
        return len(self.free) + len(self.evictable) + self.n_blocks - self.allocated

    def ready(self) -> int:
        """Blocks take() can hand out without allocating."""
        return len(self.free) + len(self.evictable)

    def add(self, new: int) -> None:
        """Blocks allocated + 1 .. new now exist (the tensors grew): free."""
        for b in range(self.allocated + 1, new + 1):  # above every block in the heap: no sift
            heapq.heappush(self.free, b)
        self.ref += [0] * (new - self.allocated)
        self.allocated = new

    def take(self) -> int:
        """A block for a sequence: a free one, else the least recently released cached one."""
        if self.free:
            b = heapq.heappop(self.free)
        else:
            b, _ = self.evictable.popitem(last=False)
            self.unregister(b)
        self.ref[b] = 1
        return b

    def addref(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.evictable[b]  # only a registered block is ever adopted
        self.ref[b] += 1

    def unref(self, b: int, keep_cached: bool = True) -> None:
        """keep_cached: a registered block no sequence holds stays cached (evictable), else it
        leaves the registry and is free."""
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if not keep_cached:
                self.unregister(b)
            if b in self.hash_of:
                self.evictable[b] = None  # most recently released last
            else:
                heapq.heappush(self.free, b)

    def register(self, b: int, h: bytes) -> None:
        if h not in self.registry and b not in self.hash_of:  # a duplicate stays private
            self.registry[h], self.hash_of[b] = b, h

    def unregister(self, b: int) -> None:
        h = self.hash_of.pop(b, None)
        if h is not None:
            del self.registry[h]


class KVCache:
    """Paged KV cache for one model (one tensor-parallel rank).

    Sizing: exactly one of budget_bytes (keys + values of every layer, the scratch block included)
    or budget_tokens (tokens held at once, all sequences together). initial_tokens: allocate that
    much and grow the pool (by doubling, copying it) up to the budget as needed; None allocates the
    whole budget now. max_seqs: keep at most this many sequences; past it the least recently used
    idle sequence is dropped (None: bounded by blocks only). prefix_cache: share full blocks
    between sequences with the same token prefix (module docstring).

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
        prefix_cache: bool = False,
    ):
        if (budget_bytes is None) == (budget_tokens is None):
            raise ValueError("give exactly one of budget_bytes, budget_tokens")
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device, self.block_size, self.max_seqs = dtype, torch.device(device), block_size, max_seqs
        self.prefix_cache = prefix_cache
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
        self.pool = BlockPool(self.n_blocks)
        self._grow(self.n_blocks if initial_tokens is None else min(self.n_blocks, cdiv(initial_tokens, block_size)))
        # Per sequence id (a row of the block table): its record; keys map to ids, least recent first.
        self.seq_of: OrderedDict[str, int] = OrderedDict()
        self.seqs: list[SeqRecord] = []
        self.free_seqs: list[int] = []
        # Prefix cache hits: tokens adopted per key since the caller last took them, and in all.
        self.hits: dict[str, int] = {}
        self.hit_tokens_total = 0
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
        """Blocks a new block can come from: free, not yet allocated, or cached but held by none."""
        return self.pool.free_blocks()

    def free_tokens(self) -> int:
        """Tokens that whole free blocks hold; room left in sequences' last blocks is not counted."""
        return self.free_blocks() * self.block_size

    def take_hits(self, keys: list[str]) -> list[int]:
        """Prefix cache hit tokens of each key since the last call (then zero)."""
        return [self.hits.pop(key, 0) for key in keys]

    # ---- the content rule
    def valid(self, key: str, tokens: list[int]) -> int:
        """How many of `tokens` the key's sequence already holds (0 for an unknown key). Where
        tokens declare their committed part (contracts.RowTokens.final), the tokens both know to
        be committed are equal (a key's committed tokens never change), and only the rest is
        compared: O(new tokens), not O(context)."""
        s = self.seq_of.get(key)
        if s is None:
            return 0
        r = self.seqs[s]
        return common_prefix(r.tokens, tokens, min(r.final, final_of(tokens)))

    @torch.inference_mode()
    def plan(
        self, keys: list[str], tokens: list[list[int]], limits: list[int | None] | None = None, protect=()
    ) -> list[tuple[int, int]]:
        """[(seq, start)] per row: positions [0, start) of sequence `seq` are valid for the row's
        tokens; the caller feeds the rest and then calls wrote().

        At least the last token is always fed (its logits are what the caller wants), and never
        is `start` past the row's limit, for callers that need logits from a given position on.
        Each row ends up owning the blocks its tokens need (prefix cache: sharing the leading
        full blocks it adopted). All or nothing: if the blocks do not fit even after evicting idle
        sequences (least recently used first; never one of `keys` or `protect`), raises
        KVCacheFull and changes nothing; a failed allocation (a larger pool or block table)
        fails before the first change too.
        """
        if len(set(keys)) != len(keys):
            raise ValueError(f"a key appears twice in one call: {keys}")
        if not all(tokens):
            raise ValueError("every row needs at least one token")
        limits = limits or [None] * len(keys)
        starts = [self._start(key, toks, limit) for key, toks, limit in zip(keys, tokens, limits)]
        # A row's own registered blocks that it may write into in place must not be adopted by
        # another row of the same call.
        mine = {b for key, st in zip(keys, starts) for b in self._writable(key, st)}
        edits = [self._edit(key, toks, st, mine) for key, toks, st in zip(keys, tokens, starts)]
        victims = self._victims(keys, edits, set(keys) | set(protect))
        # What could fail, before anything changes: memory for the pool (grown before a cached
        # block is evicted, as taking one at a time would) and for the block table.
        need = sum(e.fresh for e in edits)
        short = min(self.n_blocks - self.pool.allocated, need - len(self.pool.free))
        if short > 0:
            self._grow(short)
        self._fit_table(sum(key not in self.seq_of for key in keys), max((e.n_blocks for e in edits), default=0))

        for key in victims:
            self._drop(key)
        seqs = [self._seq(key) for key in keys]
        for e in edits:  # let go first: freed blocks serve the growth below
            for b in e.released:  # rolled back (rejected drafts): rarely asked for again, so free
                self.pool.unref(b, keep_cached=False)
        for e in edits:  # then adopt: a cached block is taken before any eviction could reach it
            for b in e.adopted:
                self.pool.addref(b)
        for key, s, e, toks in zip(keys, seqs, edits, tokens):
            for b in e.written:
                self.pool.unregister(b)
            self._apply(s, e, toks)
            hit = len(e.adopted) * self.block_size
            if hit:
                self.hits[key] = self.hits.get(key, 0) + hit
                self.hit_tokens_total += hit
        # Copy sources only now: freed earlier, one could have become another row's fresh block
        # and been copied into before its own copy was read. (_victims counts none of them as
        # freed: at worst one more idle sequence is evicted.)
        for e in edits:
            if e.copy_from is not None:
                self.pool.unref(e.copy_from, keep_cached=False)
        if self.max_seqs is not None and len(self.seq_of) > self.max_seqs:
            idle = [k for k in self.seq_of if k not in keys and k not in protect]
            for key in idle[: max(0, len(self.seq_of) - self.max_seqs)]:
                self._drop(key)
        return [(s, e.start) for s, e in zip(seqs, edits)]

    def _start(self, key: str, toks: list[int], limit: int | None) -> tuple[int, int]:
        """(start, cap): the row's valid prefix before any adoption, and how far it may go."""
        cap = len(toks) - 1 if limit is None else min(len(toks) - 1, limit)
        return min(self.valid(key, toks), cap), cap

    def _writable(self, key: str, start_cap: tuple[int, int]) -> list[int]:
        """The key's registered blocks held by it alone from its valid prefix's last block on."""
        s = self.seq_of.get(key)
        if s is None or not self.prefix_cache:
            return []
        old = self.seqs[s].blocks[start_cap[0] // self.block_size :]
        return [b for b in old if self.pool.ref[b] == 1 and b in self.pool.hash_of]

    def _edit(self, key: str, toks: list[int], start_cap: tuple[int, int], avoid: set) -> _Edit:
        """One row's plan, nothing changed yet: keep its valid blocks, adopt cached full blocks
        after them (none in `avoid`), and write the rest into blocks it alone holds (fresh ones
        where a block is shared). Reads only the row's blocks from its valid prefix's on."""
        bs, (start, cap) = self.block_size, start_cap
        s = self.seq_of.get(key)
        r = None if s is None else self.seqs[s]
        old = [] if r is None else r.blocks
        lo = start // bs  # blocks [0, lo) hold only valid positions: kept as they are
        adopted, hashes = [], []
        if self.prefix_cache:
            parent = r.hashes[lo - 1] if r is not None and 0 < lo <= len(r.hashes) else b""
            for i in range(lo, cap // bs):  # only blocks that end at or before cap
                h = block_hash(hashes[-1] if hashes else parent, toks[i * bs : (i + 1) * bs])
                b = self.pool.registry.get(h)
                if b is None or b in avoid:
                    break
                adopted.append(b)
                hashes.append(h)
        if adopted:
            start = (lo + len(adopted)) * bs
        n_need = cdiv(len(toks), bs)
        tail = list(adopted)
        e = _Edit(start, lo, tail, hashes, held=start_cap[0])
        for i in range(lo + len(tail), n_need):  # the blocks written into
            b = old[i] if i < len(old) else None
            if b is not None and self.pool.ref[b] == 1 and b not in adopted:
                tail.append(b)  # its own: written in place
                e.written.append(b)
            else:
                tail.append(FRESH)
                if b is not None and i * bs < start:  # shared, and its head is still valid
                    e.copy_from = b
        e.adopted = [b for i, b in enumerate(adopted) if i + lo >= len(old) or old[i + lo] != b]
        kept = set(tail) | {e.copy_from}  # a copy's source is let go of after every copy (plan)
        e.released = [b for b in old[lo:] if b not in kept]
        return e

    def _victims(self, keys: list[str], edits: list[_Edit], busy: set) -> list[str]:
        """The idle keys to evict, least recently used first, so that every row's fresh blocks fit;
        raises KVCacheFull (naming the first row that does not fit) when even all of them would
        not do. Counts by projected refcounts: a released block another sequence still holds
        frees nothing, and a cached block a row adopts is no longer free."""
        refs: dict[int, int] = {}
        ref = self.pool.ref

        def change(b: int, d: int) -> int:  # the change in free blocks
            before = refs.get(b, ref[b])
            refs[b] = before + d
            return (refs[b] == 0) - (before == 0)

        free = self.free_blocks()
        for e in edits:
            free += sum(change(b, -1) for b in e.released)
        for e in edits:
            free += sum(change(b, +1) for b in e.adopted)
        need = sum(e.fresh for e in edits)
        victims = []
        for key in self.seq_of:
            if free >= need:
                break
            if key not in busy:
                victims.append(key)
                free += sum(change(b, -1) for b in self.seqs[self.seq_of[key]].blocks)
        if free < need:
            for key, e in zip(keys, edits):
                if e.fresh > free:
                    raise KVCacheFull(key, e.fresh, free)
                free -= e.fresh
        return victims

    def wrote(self, seq: int, tokens: list[int]):
        """Record that `tokens` were written after the sequence's valid prefix; with the prefix
        cache, register the blocks that are now full."""
        r = self.seqs[seq]
        r.tokens.extend(tokens)  # in place: a round adds a few tokens to a long sequence
        toks = r.tokens
        assert len(toks) <= len(r.blocks) * self.block_size
        if not self.prefix_cache:
            return
        bs = self.block_size
        for i in range(len(r.hashes), len(toks) // bs):
            h = block_hash(r.hashes[-1] if r.hashes else b"", toks[i * bs : (i + 1) * bs])
            r.hashes.append(h)
            self.pool.register(r.blocks[i], h)

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
        b = self.seqs[seq].blocks
        if len(b) < n_blocks or b[:n_blocks] != list(range(b[0], b[0] + n_blocks)):
            return None
        return b[0] * self.block_size

    # ---- bookkeeping
    def _fit_table(self, new_seqs: int, n_blocks: int) -> None:
        """Rows for new_seqs more sequences and n_blocks columns in the block table (allocations
        an update makes before it changes anything)."""
        rows = len(self.seqs) + max(0, new_seqs - len(self.free_seqs))  # new ids after the free ones
        if rows > self.table.shape[0]:
            pad = torch.full((max(rows, 2 * self.table.shape[0]) - self.table.shape[0], self.table.shape[1]), SCRATCH)
            self.table = torch.cat([self.table, pad.long()])
        if n_blocks > self.table.shape[1]:
            self._widen(n_blocks)

    def _seq(self, key: str) -> int:
        """The key's sequence id, made most recently used; a new key takes a free id (its table
        row exists: _fit_table)."""
        if key in self.seq_of:
            self.seq_of.move_to_end(key)
            return self.seq_of[key]
        if self.free_seqs:
            s = self.free_seqs.pop()
        else:
            s = len(self.seqs)
            self.seqs.append(SeqRecord())
        self.seq_of[key] = s
        return s

    def _apply(self, seq: int, e: _Edit, toks: list[int]):
        """The row's new blocks, tokens and hashes (its releases and adoptions already done), in
        place from block e.lo on: O(new tokens)."""
        tail = list(e.tail)
        for i, b in enumerate(tail):
            if b == FRESH:
                tail[i] = self.pool.take()
                if e.copy_from is not None and e.lo + i == e.start // self.block_size:  # the first fresh one
                    self._copy(e.copy_from, tail[i])
        r = self.seqs[seq]
        n_old, lo = len(r.blocks), e.lo
        if r.blocks[lo : lo + len(tail)] != tail:  # the block table changes only where the blocks do
            self.table[seq, lo : lo + len(tail)] = torch.tensor(tail, dtype=torch.long)
        if n_old > lo + len(tail):
            self.table[seq, lo + len(tail) : n_old] = SCRATCH
        del r.blocks[lo:]
        r.blocks.extend(tail)
        # Its first `held` tokens already are the row's; adopted blocks hold the row's own tokens
        # (their hash)
        del r.tokens[e.held :]
        r.tokens.extend(toks[e.held : e.start])
        r.final = min(final_of(toks), e.start)
        del r.hashes[lo:]
        r.hashes.extend(e.hashes)

    def _drop(self, key: str):
        s = self.seq_of.pop(key, None)
        if s is not None:
            r = self.seqs[s]
            for b in r.blocks:
                self.pool.unref(b)
            self.table[s, : len(r.blocks)] = SCRATCH
            self.seqs[s] = SeqRecord()
            self.hits.pop(key, None)
            self.free_seqs.append(s)

    def _copy(self, src: int, dst: int):
        bs = self.block_size
        for pool in (*self.k, *self.v):
            pool[dst * bs : (dst + 1) * bs] = pool[src * bs : (src + 1) * bs]

    def _widen(self, n_blocks: int):
        rows, width = self.table.shape
        pad = torch.full((rows, max(n_blocks, 2 * width) - width), SCRATCH, dtype=torch.long)
        self.table = torch.cat([self.table, pad], 1)

    def _grow(self, at_least: int):
        """Add blocks to the pool (at least `at_least`, within the budget), doubling so that
        growing to the budget copies the pool only a few times. The tensors grow first, one layer
        at a time (the peak is one layer's copy); the pool counts the blocks only once all exist."""
        allocated = self.pool.allocated
        new = min(self.n_blocks, max(allocated + at_least, 2 * allocated))
        rows = (new + 1) * self.block_size  # + the scratch block
        for pool in (self.k, self.v):
            for i, old in enumerate(pool):
                if len(old) >= rows:  # grown by an attempt that failed at a later layer
                    continue
                # Zeros, not empty: masked values are still multiplied by 0, and 0 * NaN is NaN.
                pool[i] = torch.zeros((rows, self.kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
                pool[i][: len(old)] = old
        self.pool.add(new)
