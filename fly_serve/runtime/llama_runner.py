"""A model runtime on llama.cpp's CPU kernels: a GGUF model run at its file's quantization (no
dequantization; a drafter's file may be a requantized one, loading/gguf_requant.py), through
llama-cpp-python's C API.

It offers the scorer and the model drafter what runner.Runner offers them (contracts.ModelRunner):
`feed` brings each row's KV cache up to its tokens in one batched `llama_decode` and returns logits
at the positions asked for, `catch_up` prefills rows that lag, `release` forgets rows. Sampling,
the entropy gate, the window and grammar masks stay in torch on top, reading these logits.

The KV cache is llama.cpp's, one buffer for all sequences (`kv_unified`): a row is a llama.cpp
sequence id, and the tokens it holds are remembered here, so the same content rule as kv_cache.py
applies: keep the common prefix of what the sequence holds and what the row now is, remove the rest
(`llama_memory_seq_rm`: rejected drafts roll back), feed what is missing. Prefix sharing: a new
row adopts the longest prefix it shares with a row held (`llama_memory_seq_cp` marks the same
cells as the new sequence's too: shared, not copied) or with a released row, a donor. Donors are
kept out of llama.cpp's cache, as bytes in host memory (`llama_state_seq_get_data`, restored with
`llama_state_seq_set_data`): every query of every forward scans every cell of the unified cache
(its flash attention skips a masked cell only after reading the mask), so cells kept for later
would slow each token of every row now (8 donors of 1,000 tokens: ~7% a token of the 1.5B target,
docs/journal.md "Donors out of the cache"). Donors hold at most capacity_tokens tokens together,
n_slots at most, least recently used dropped first; a donor that a newer one extends is dropped.

Reproducible (`set_reproducible`, EngineConfig.reproducible): llama.cpp picks its CPU kernels by the
forward's shape, and the kernels sum in different orders, so a position's logits depend on how many
tokens its forward carried and beside which rows (measured: up to 0.6 in a logit of the 1.5B
target, enough to flip a greedy token now and then): weights repacked for its gemm kernels (>= 4
rows), its tiled K-quant matmul (>= 8 rows), its tiled flash attention (>= 64 query rows) and its
split-KV attention (one query row over >= 512 cells). Reproducible mode keeps every forward on the
kernels that compute each row alone in one order: weights as shipped (no repack), the tiled matmul
off (GGML_CPU_TILED_MM=0, read once per process), forwards of at most REPRODUCIBLE_UBATCH tokens and
never of one token alone (a lone token is fed with the one before it again). Then a position's
logits are bit for bit the same in a plain step, in a verification of any width and in any batch
(tests/test_reproducible.py), so a greedy request gives one text however rounds and batches fell,
and strict speculative decoding gives plain decoding's text exactly; what it costs is measured in
docs/benchmarks.md.

Sequence ids are llama.cpp's own maximum (llama_max_parallel_sequences, 256; fewer only if the
cells or a batch's tokens are fewer), one kept for the health probe: what limits the rows held is the cells, so a
drafter replica drafting for several ingress units never evicts a row for want of an id. An idle
row evicted all the same (no free id, or no room for a batch) prefills again on its next call:
each is counted (`SeqTable.evicted`) and logged. The ids cost llama.cpp's logits buffer, which it
reserves for at least n_seq_max outputs (n_seq_max x vocab floats).
"""

import ctypes
import itertools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .kv_cache import KVCacheFull, common_prefix

log = logging.getLogger("fly_serve.runtime.llama_runner")

MIN_SHARED = 16  # a prefix shorter than this is fed rather than adopted (a chat template's opening)
# Tokens a reproducible forward carries at most: below the 64 query rows where llama.cpp's flash
# attention switches to its tiled kernel (module docstring).
REPRODUCIBLE_UBATCH = 32


class LlamaCppMissing(RuntimeError):
    """The native part (llama-cpp-python) is not importable: named, with how to get it."""


_LIB = None
MAX_VIEWS = 64  # logits views kept (LlamaRunner._logits_view)


def lib():
    """llama-cpp-python's C API, its backend initialised once per process (its log kept to errors)."""
    global _LIB
    if _LIB is None:
        try:
            import llama_cpp
        except Exception as e:  # an ImportError, or an OSError of a shared library that failed to load
            raise LlamaCppMissing(
                "runtime llama.cpp: the package llama-cpp-python is not importable "
                f"({type(e).__name__}: {e}). It builds llama.cpp from source at `pip install -e .`, "
                "which needs cmake, a C++17 compiler (g++) and ninja or make; install those and run "
                "`pip install --force-reinstall --no-deps llama-cpp-python`, or use runtime torch"
            ) from e
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
        _LIB = llama_cpp
    return _LIB


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, _):
    if level >= 3 and level != 5:  # ggml_log_level: WARN 3, ERROR 4 (CONT 5 continues a line; INFO 2)
        log.log(
            logging.WARNING if level == 4 else logging.INFO,
            "llama.cpp: %s",
            (text or b"").decode(errors="replace").rstrip(),
        )


_REPRODUCIBLE = False  # this process's kernels are shape-invariant (set_reproducible)
_DECODED = False  # a forward ran in this process: llama.cpp has read its kernel switches


def set_reproducible(on: bool) -> None:
    """Shape-invariant kernels for every llama.cpp model this process loads from now (module
    docstring). Process-wide and for good, since llama.cpp reads its tiled-matmul switch once: on
    before the process's first forward; asking for off afterwards raises."""
    global _REPRODUCIBLE
    if on == _REPRODUCIBLE:
        return
    if not on:
        raise RuntimeError("reproducible: this process already runs llama.cpp reproducibly (kernels are chosen once)")
    if _DECODED and os.environ.get("GGML_CPU_TILED_MM") != "0":
        raise RuntimeError("reproducible: must be chosen before this process's first llama.cpp forward")
    os.environ["GGML_CPU_TILED_MM"] = "0"
    _REPRODUCIBLE = True


def reproducible() -> bool:
    return _REPRODUCIBLE


def available() -> bool:
    try:
        lib()
        return True
    except LlamaCppMissing:
        return False


def system_info() -> str:
    """What llama.cpp was built for (its CPU features), for a benchmark's record."""
    return lib().llama_print_system_info().decode()


def amx_kernels_unsafe() -> bool:
    """Whether llama.cpp was built with its AMX kernels and would use them here. They crashed
    (SIGSEGV in ggml_backend_amx_mul_mat, Q4_K weights) on the Sapphire Rapids VM this was
    developed on, though the kernel grants the AMX state, so a build with AMX keeps the weights
    as shipped (no repacking at all: llama.cpp offers no switch for AMX alone)."""
    return "AMX_INT8 = 1" in system_info()


class GGUFModel:
    """A GGUF file loaded once (memory-mapped, CPU): what a LlamaRunner's contexts run."""

    def __init__(self, path: str, repack: bool | None = None):
        """repack: let llama.cpp repack the weights for its faster CPU kernels (its "extra buffer
        types"); None: unless its AMX kernels would take them (amx_kernels_unsafe) or the process
        is reproducible (their gemm sums in another order than their gemv)."""
        L = lib()
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        if repack is None:
            repack = not (amx_kernels_unsafe() or reproducible())
        params.use_extra_bufts = repack
        self.path, self.repacked = str(path), repack
        self.ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise ValueError(f"model: llama.cpp could not load {self.path!r} as a GGUF model")
        vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.ptr)
        self.swa = L.llama_model_n_swa(self.ptr)  # > 0: layers that attend to the last swa positions only

    def __del__(self):
        if getattr(self, "ptr", None) and _LIB is not None:
            _LIB.llama_model_free(self.ptr)
            self.ptr = None


@dataclass
class _Seq:
    id: int  # the llama.cpp sequence id
    tokens: list[int] = field(default_factory=list)  # what its cells hold, positions 0..len-1


@dataclass
class _Donor:
    """A released row's KV as llama.cpp wrote it out (llama_state_seq_get_data): no cells, no id."""

    tokens: list[int]
    state: ctypes.Array


class SeqTable:
    """Which llama.cpp sequence holds which row, and what it holds: the bookkeeping that makes
    llama.cpp's cache follow kv_cache.py's content rule. Held rows and (with the prefix cache)
    released donors are kept in least-recently-used order."""

    def __init__(
        self, ctx, n_ids: int, capacity_tokens: int, prefix_cache: bool, max_donors: int | None = None, swa: int = 0
    ):
        self.ctx, self.mem = ctx, lib().llama_get_memory(ctx)
        # A model with windowed layers (Gemma 3) writes a sequence out without its cells older than
        # the window before its last position: such a donor serves a row that continues all of it.
        self.swa = swa
        self.capacity_tokens, self.prefix_cache = capacity_tokens, prefix_cache
        # donors kept at most (each new row is compared with every one)
        self.max_donors = n_ids if max_donors is None else max_donors
        self.free_ids = list(range(n_ids))
        self.rows: OrderedDict[str, _Seq] = OrderedDict()
        self.donors: OrderedDict[int, _Donor] = OrderedDict()  # released rows kept for their prefix
        self.donor_tokens = 0
        self._donor_ids = itertools.count()
        self.hits: dict[str, int] = {}
        self.hit_tokens_total = 0
        self.evicted = 0  # rows (not donors) evicted while held: each prefills again when it returns

    # ---- what kv_cache.KVCache answers the same way
    def valid(self, key: str, tokens: list[int]) -> int:
        s = self.rows.get(key)
        return 0 if s is None else common_prefix(s.tokens, tokens)

    def take_hits(self, keys: list[str]) -> list[int]:
        return [self.hits.pop(key, 0) for key in keys]

    # ---- the content rule
    def plan(self, keys: list[str], tokens: list[list[int]], limits, protect=()) -> list[tuple[_Seq, int]]:
        """[(seq, start)] per row: its cells hold tokens[:start] (the rest removed), the caller feeds
        the rest. Never is start past the row's limit; without one, at least the last token is fed
        (its logits are wanted). A limit of len(tokens) may leave nothing to feed."""
        if len(set(keys)) != len(keys):
            raise ValueError(f"a key appears twice in one call: {keys}")
        if not all(tokens):
            raise ValueError("every row needs at least one token")
        busy = set(keys) | set(protect)
        plans = []
        for key, toks, limit in zip(keys, tokens, limits or [None] * len(keys)):
            cap = len(toks) - 1 if limit is None else min(len(toks), limit)
            s = self.rows.get(key)
            if s is None:
                s = self.rows[key] = _Seq(self._take_id(busy))
                self._adopt(key, s, toks, cap)
            self.rows.move_to_end(key)
            start = min(common_prefix(s.tokens, toks), cap)
            self.cut(s, start)
            plans.append((s, start))
        return plans

    def cut(self, s: _Seq, n: int) -> None:
        """Keep only the first n tokens of sequence s."""
        if n < len(s.tokens):
            lib().llama_memory_seq_rm(self.mem, s.id, n, -1)
            del s.tokens[n:]

    def roll_back(self, s: _Seq, n: int) -> None:
        """Sequence s back to its first n tokens, its cells past them removed even where s.tokens
        does not hold them: a forward that failed after an earlier call of it (a split forward, a
        long one) had written cells that s.tokens never recorded."""
        lib().llama_memory_seq_rm(self.mem, s.id, n, -1)
        del s.tokens[n:]

    def _adopt(self, key: str, s: _Seq, toks: list[int], cap: int) -> None:
        """A new row takes the longest prefix a held row or a donor shares with it (prefix cache)."""
        if not self.prefix_cache:
            return
        best, n = None, 0  # a held row's _Seq, or a donor's key
        for other in self.rows.values():
            m = min(common_prefix(other.tokens, toks), cap) if other is not s else 0
            if m > n:
                best, n = other, m
        for k, donor in self.donors.items():
            m = min(common_prefix(donor.tokens, toks), cap)
            if m > n and self._restorable(donor, m):
                best, n = k, m
        if best is None or n < MIN_SHARED:
            return
        if isinstance(best, _Seq):
            lib().llama_memory_seq_cp(self.mem, best.id, s.id, 0, n)
        else:
            if not self._restore(self.donors[best], s.id):
                return
            self.donors.move_to_end(best)
            lib().llama_memory_seq_rm(self.mem, s.id, n, -1)
        s.tokens = list(toks[:n])
        self.hits[key] = self.hits.get(key, 0) + n
        self.hit_tokens_total += n

    def _restorable(self, donor: _Donor, n: int) -> bool:
        """Whether n tokens of the donor can come back: all its cells fit beside the rows' (counted
        as if none were shared: a row prefills rather than fail a restore), and a windowed model's
        row continues the whole donor (module docstring)."""
        held = sum(len(r.tokens) for r in self.rows.values())
        fits = held + len(donor.tokens) <= self.capacity_tokens
        return fits and (self.swa <= 0 or len(donor.tokens) <= self.swa or n >= len(donor.tokens) - 1)

    def _restore(self, donor: _Donor, seq: int) -> bool:
        """The donor's cells written back as sequence seq's; False where llama.cpp finds no room for
        all of them: the row then prefills, as without a donor."""
        L = lib()
        if L.llama_state_seq_set_data(self.ctx, donor.state, len(donor.state), seq) == len(donor.state):
            return True
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        log.debug("llama.cpp cache: no room to restore a donor of %d tokens; prefilling", len(donor.tokens))
        return False

    def _take_id(self, busy: set) -> int:
        if not self.free_ids and not self.evict_one(busy):
            raise KVCacheFull("<new sequence>", 1, 0)
        return self.free_ids.pop()

    def evict_one(self, busy: set) -> bool:
        """Free the least recently used idle row (donors hold no cells or ids); False if every row
        is busy."""
        for key in self.rows:
            if key not in busy:
                s = self.rows.pop(key)
                self.evicted += 1
                log.warning(
                    "llama.cpp cache: row %s evicted (%d tokens) for a sequence id or room; it prefills again "
                    "when it returns (%d rows evicted so far)",
                    key,
                    len(s.tokens),
                    self.evicted,
                )
                self._forget(s)
                return True
        return False

    def release(self, keys) -> None:
        for key in keys:
            s = self.rows.pop(key, None)
            self.hits.pop(key, None)
            if s is None:
                continue
            if self.prefix_cache and len(s.tokens) >= MIN_SHARED:
                self._keep(s)
            self._forget(s)

    def _keep(self, s: _Seq) -> None:
        """Sequence s's KV copied out as a donor (dropped where llama.cpp writes nothing), then the
        least recently used donors past the bounds dropped. Without a window, a donor holding all of
        s already serves every row s could (s is not copied), and donors s extends are dropped."""
        if self.swa <= 0:
            covers = [k for k, d in self.donors.items() if common_prefix(d.tokens, s.tokens) == len(s.tokens)]
            if covers:
                self.donors.move_to_end(covers[0])
                return
        L = lib()
        size = L.llama_state_seq_get_size(self.ctx, s.id)
        state = (ctypes.c_uint8 * size)()
        if size == 0 or L.llama_state_seq_get_data(self.ctx, state, size, s.id) != size:
            return
        if self.swa <= 0:
            for k in [k for k, d in self.donors.items() if common_prefix(d.tokens, s.tokens) == len(d.tokens)]:
                self.donor_tokens -= len(self.donors.pop(k).tokens)
        self.donors[next(self._donor_ids)] = _Donor(list(s.tokens), state)
        self.donor_tokens += len(s.tokens)
        while len(self.donors) > self.max_donors or self.donor_tokens > self.capacity_tokens:
            self.donor_tokens -= len(self.donors.popitem(last=False)[1].tokens)

    def _forget(self, s: _Seq) -> None:
        lib().llama_memory_seq_rm(self.mem, s.id, -1, -1)
        s.tokens = []
        self.free_ids.append(s.id)


class _Batch:
    """A llama_batch over numpy arrays of n tokens at most (one sequence id a token)."""

    def __init__(self, n: int):
        L = lib()
        self.token = np.zeros(n, np.int32)
        self.pos = np.zeros(n, np.int32)
        self.n_seq_id = np.ones(n, np.int32)
        self.seq = np.zeros(n, np.int32)
        self.logits = np.zeros(n, np.int8)
        ptr = ctypes.POINTER(ctypes.c_int32)
        self.seq_ptrs = (ptr * n)(*[ctypes.cast(self.seq.ctypes.data + 4 * i, ptr) for i in range(n)])
        self.c = L.llama_batch()
        self.c.token = self.token.ctypes.data_as(ptr)
        self.c.embd = ctypes.POINTER(ctypes.c_float)()
        self.c.pos = self.pos.ctypes.data_as(ptr)
        self.c.n_seq_id = self.n_seq_id.ctypes.data_as(ptr)
        self.c.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ptr))
        self.c.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


def default_threads() -> int:
    """This process's cores: what Ray gave it (its affinity) or the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class LlamaRunner:
    """contexts of one GGUFModel, with runner.Runner's surface (module docstring)."""

    device = torch.device("cpu")
    graphs = None  # nothing is captured (engine.set_draft_ahead turns graphs off on parts it shares)
    fold = False
    widths: list[tuple[int, ...]] | None = None  # set_widths

    def __init__(
        self,
        model: GGUFModel,
        n_slots: int = 8,
        budget_tokens: int | None = None,
        prefix_cache: bool = False,
        threads: int = 0,
        batch_tokens: int = 512,
    ):
        L = lib()
        self.model = model
        self.vocab_size = model.n_vocab
        self.reproducible = reproducible()
        if self.reproducible:  # module docstring: no repacked weights, no forward past the small kernels
            if model.repacked:
                raise RuntimeError(f"reproducible: {model.path} was loaded with repacked weights before the choice")
            batch_tokens = min(batch_tokens, REPRODUCIBLE_UBATCH)
        capacity = budget_tokens or n_slots * 4096
        params = L.llama_context_default_params()
        params.n_ctx = capacity
        params.n_batch = params.n_ubatch = batch_tokens
        # ids as many as llama.cpp allows (module docstring): the cells, not the ids, bound the rows
        # (no more than a batch's tokens either: llama.cpp plans a batch of one token per sequence)
        params.n_seq_max = min(L.llama_max_parallel_sequences(), capacity, batch_tokens)
        params.kv_unified = True  # one pool: rows of any lengths in one forward, prefixes shared
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # skips the other rows' masked cells
        params.no_perf = True
        self.threads = threads or default_threads()
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = L.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {capacity} tokens for {model.path}")
        self.batch_tokens = batch_tokens
        self.batch = _Batch(batch_tokens)
        self.probe_seq = params.n_seq_max - 1  # the health probe's own id (probe), never a row's
        self.cache = SeqTable(self.ctx, self.probe_seq, capacity, prefix_cache, max_donors=n_slots, swa=model.swa)
        self._probe_batch: _Batch | None = None
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # _logits_view's, by (buffer address, rows)

    def set_threads(self, n: int) -> None:
        self.threads = n
        lib().llama_set_n_threads(self.ctx, n, n)

    def __del__(self):
        if getattr(self, "ctx", None) and _LIB is not None:
            _LIB.llama_free(self.ctx)
            self.ctx = None

    def feed(self, keys: list[str], tokens: list[list[int]], tail: list[int] | None = None, logits=True, protect=()):
        """runner.Runner.feed: bring each row's cache up to its tokens; returns (logits, fed).
        Without `tail`, logits [B, max(fed), V] of every fed position (right-padded); with it,
        logits [B, max(tail), V] of each row's last tail[b] tokens (left-aligned), fed even if
        cached; logits False: None. Padding positions hold zeros. Raises KVCacheFull when the
        tokens do not fit after evicting idle sequences (what this call fed is then removed)."""
        limits = None if tail is None else [len(t) - n for t, n in zip(tokens, tail)]
        if not logits and tail is None:  # no logits wanted: a row whose every token is cached feeds none
            limits = [len(t) for t in tokens]
        plans = self.cache.plan(keys, tokens, limits, protect)
        fed = [len(toks) - start for (_, start), toks in zip(plans, tokens)]
        if not logits:
            want = [0] * len(keys)
        else:
            want = fed if tail is None else tail
        if self.reproducible and sum(fed) == 1 and plans[fed.index(1)][1] > 0:
            # a lone token takes llama.cpp's split-KV attention: the token before it goes again
            b = fed.index(1)
            limits = list(limits or [len(t) - 1 for t in tokens])  # as plan caps a row without one
            limits[b] = plans[b][1] - 1
            plans = self.cache.plan(keys, tokens, limits, protect)
            fed = [len(toks) - start for (_, start), toks in zip(plans, tokens)]
        try:
            out = self._decode(plans, tokens, want, set(keys) | set(protect))
        except BaseException:
            for s, start in plans:  # nothing half-written stays: each row holds its valid prefix
                self.cache.roll_back(s, start)
            raise
        for (s, start), toks in zip(plans, tokens):
            s.tokens.extend(toks[start:])
        return out, fed

    def _decode(self, plans, tokens, want: list[int], busy: set) -> torch.Tensor | None:
        """Every row's fed tokens, in order, in llama_decode calls of batch_tokens at most; the
        logits of the last want[b] tokens of each row, [B, max(want), V] (None if none is wanted).

        llama.cpp writes the logits it was asked for into its own buffer, [outputs, V] in batch
        order, which is [B, w, V] row-major when every row wants the same w and one call fed
        them all: then that buffer is returned as it is, no copy and no allocation (a plain step
        and a round of equal drafts; the view lives until this runner's next call, and every
        reader is done with a round's logits before its next feed). Otherwise each wanted row is
        copied once into its slot, and only the padding slots are zeroed."""
        fed = [len(toks) - start for (_, start), toks in zip(plans, tokens)]
        if not any(fed):  # every row cached whole (a catch-up that adopted a donor's cells): no call
            return None
        rows = np.repeat(np.arange(len(plans)), fed)  # [N]: the row of each fed token
        pos = np.concatenate([np.arange(start, len(toks), dtype=np.int32) for (_, start), toks in zip(plans, tokens)])
        ids = np.concatenate([np.asarray(toks[start:], np.int32) for (_, start), toks in zip(plans, tokens)])
        seqs = np.repeat([s.id for s, _ in plans], fed).astype(np.int32)
        first = np.array([len(toks) - w for toks, w in zip(tokens, want)])[rows]  # first wanted position
        wanted, slot = pos >= first, pos - first  # [N]; slot: where a wanted token's logits go in out
        width = max(want)
        chunks = self._chunks(len(ids))
        if width > 0 and len(chunks) == 1 and min(want) == width:
            self._decode_chunk(ids, pos, seqs, wanted, busy)
            return self._logits_view(len(plans) * width).view(len(plans), width, self.vocab_size)
        out = torch.empty(len(plans), width, self.vocab_size) if width > 0 else None
        for b, w in enumerate(want):  # the padding slots (the contract: zeros)
            if out is not None and w < width:
                out[b, w:].zero_()
        for lo, hi in chunks:
            self._decode_chunk(ids[lo:hi], pos[lo:hi], seqs[lo:hi], wanted[lo:hi], busy)
            got = np.nonzero(wanted[lo:hi])[0] + lo
            if out is not None and len(got):
                out[torch.from_numpy(rows[got]), torch.from_numpy(slot[got])] = self._logits_view(len(got))
        return out

    def set_widths(self, plan: list[tuple[int, ...]] | None) -> None:
        """forward_widths.plan: the calls' widths of a forward of n <= len(plan) tokens (None: one
        call per batch_tokens). Not in reproducible mode, whose forwards have their own rule."""
        self.widths = None if self.reproducible or not plan else plan[: self.batch_tokens]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) of each llama_decode call over n tokens: as the width plan splits n where it
        has one (set_widths), else batch_tokens at most; a reproducible runner never leaves one
        token alone in a call (module docstring)."""
        if self.widths and n <= len(self.widths):
            bounds = [0, *itertools.accumulate(self.widths[n - 1])]
            return list(zip(bounds[:-1], bounds[1:]))
        bounds = list(range(0, n, self.batch_tokens)) + [n]
        if self.reproducible and len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
            bounds[-2] -= 1
        return list(zip(bounds[:-1], bounds[1:]))

    def _logits_view(self, n: int) -> torch.Tensor:
        """The last call's n output rows of logits [n, V], read in place (llama.cpp's buffer).
        Views are kept by the buffer's address: making one (numpy builds a ctypes array type
        for it) cost ~0.1 ms, a plain step's largest host cost after the forward."""
        ptr = lib().llama_get_logits(self.ctx)
        key = (ctypes.cast(ptr, ctypes.c_void_p).value, n)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_VIEWS:  # llama.cpp moved its buffer, or many widths came
                self._views.clear()
            view = self._views[key] = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n, self.vocab_size)))
        return view

    def _decode_chunk(self, ids, pos, seqs, wanted, busy: set) -> None:
        """One llama_decode of these tokens (at most batch_tokens), logits where `wanted`."""
        global _DECODED
        _DECODED = True
        n = len(ids)
        b = self.batch
        b.token[:n], b.pos[:n], b.seq[:n], b.logits[:n] = ids, pos, seqs, wanted
        b.c.n_tokens = n
        L = lib()
        while True:
            rc = L.llama_decode(self.ctx, b.c)
            if rc == 0:
                return
            if rc == 1 and self.cache.evict_one(busy):
                continue  # no room for the batch: an idle sequence gave its cells, try again
            if rc == 1:
                raise KVCacheFull("<batch>", n, 0)
            raise RuntimeError(f"llama_decode failed ({rc}) on a batch of {n} tokens")

    def catch_up(self, keys: list[str], tokens: list[list[int]], max_lag: int = 1) -> None:
        """runner.Runner.catch_up, where a forward pads nothing: a lone row lagging more than
        max_lag tokens is left to the caller's next feed, its prompt in the round's own forward
        (llama.cpp's batch is flat: the other rows' tokens ride beside it unpadded). The prompt and
        the round's tokens then take one pass over the weights, and the first token comes from the
        prompt's own last position, as llama-server's does; prefilled apart (all but its last
        token, then that token alone in the round), a request's first token cost one forward more
        (docs/journal.md, "A newcomer's prompt in the round's forward"). Several lagging rows
        prefill now, together (one decode); with the prefix cache the first goes alone, so the
        others adopt the prefix it shares with them (a chat template's system prompt) rather than
        each computing its own. The round's rows are protected."""
        behind = [
            b for b, (key, toks) in enumerate(zip(keys, tokens)) if len(toks) - self.cache.valid(key, toks) > max_lag
        ]
        if len(behind) < 2:
            return
        parts = [behind[:1], behind[1:]] if self.cache.prefix_cache else [behind]
        for part in parts:
            self.feed([keys[b] for b in part], [tokens[b][:-1] for b in part], logits=False, protect=keys)

    def release(self, keys) -> None:
        self.cache.release(keys)

    def probe(self) -> torch.Tensor | None:
        """Logits [1, V] of one token through the model in the sequence id no row ever gets
        (probe_seq), removed at once: the weights are there and compute, and no row's cells, id
        or place in the eviction order is touched; nothing is evicted for it. None: no free cell
        for one token now (llama.cpp answered; a full cache is the rows' business, not a fault)."""
        L = lib()
        if self._probe_batch is None:
            self._probe_batch = _Batch(1)
        b = self._probe_batch
        b.token[0], b.pos[0], b.seq[0], b.logits[0] = 0, 0, self.probe_seq, 1
        b.c.n_tokens = 1
        try:
            rc = L.llama_decode(self.ctx, b.c)
            if rc == 1:
                return None
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}) on the health probe's token")
            ptr = L.llama_get_logits(self.ctx)
            return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(1, self.vocab_size))).clone()
        finally:
            L.llama_memory_seq_rm(self.cache.mem, self.probe_seq, -1, -1)
