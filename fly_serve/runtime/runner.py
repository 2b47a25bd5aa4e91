"""A compact batched forward for the Llama family (Llama 3.x, Qwen2/2.5, Mistral).

Weights, norms, MLPs and rotary embeddings are the transformers model's own modules; only
attention is ours, so that the KV cache is paged, with per-row lengths (see kv_cache.py).
That gives each row its own positions and lets a row roll back by forgetting tokens, with no
copying and no recomputed prefix. Rows are right-padded: row b feeds `lengths[b]` real tokens;
the padding writes cache positions that stay invisible until real tokens overwrite them (or the
scratch block, past a row's blocks).

Tensor parallelism (tp.py) shards the Linear layers Megatron-style; this forward then sees
fewer heads per rank and all-reduces the two row-parallel outputs.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .graphs import DecodeGraphs, capture_mode
from .kv_cache import KVCache, cdiv
from .kv_io import GatherIO, SliceIO

DEFAULT_SEQ_TOKENS = 4096  # the default budget: n_slots sequences of this many tokens
DEFAULT_INITIAL_TOKENS = 256  # per slot, allocated up front by default; the pool grows from there


def grown_from(device: torch.device, initial_tokens: int) -> int | None:
    """Where a default-sized pool starts: small on the CPU (memory the OS hands out lazily anyway,
    and a test machine runs many engines), the whole budget now on a GPU (None). A GPU pool that
    grew later could fail mid-run, and a drafter whose growth fails drafts nothing (the engine falls
    back to prompt lookup every round while its health probe passes): allocated at start, a budget
    that does not fit fails the replica's start, loudly."""
    return initial_tokens if device.type == "cpu" else None


def attention_mask(starts: torch.Tensor, T: int, n_keys: int, pos: torch.Tensor):
    """(attn_mask, is_causal) for SDPA: key j is visible to the query at position p iff j <= p.

    When every row starts at the same position (batch 1 always; a batch of equal lengths) that
    rule is plain causal attention, which SDPA takes without a mask tensor, so PyTorch may pick its
    fused kernels (flash, memory-efficient) instead of the math one that an explicit boolean mask
    forces with grouped KV heads: a decode step (T = 1) sees every key, a prefill from position 0
    is top-left causal (is_causal), anything else is bottom-right causal (a CausalBias, which
    dispatches to flash / memory-efficient itself). Rows of different starts need the mask
    [B, 1, T, n_keys]. starts [B] on the CPU (no device sync); pos [B, T] on the device.
    On a CPU a forward of up to FOLD_TOKENS a row folds its query heads instead and takes
    folded_mask (Runner.layers_forward): there SDPA's kernels for grouped heads cost more."""
    if bool((starts == starts[0]).all()):
        if T == 1:
            return None, False
        if n_keys == T:
            return None, True
        return causal_lower_right(T, n_keys), False
    keys = torch.arange(n_keys, device=pos.device)
    return (keys[None, None, :] <= pos[:, :, None])[:, None], False  # [B, 1, T, n_keys]


# Folded attention on a CPU (fold_queries) for forwards of up to this many tokens a row: decode
# steps, verifications and drafting, where it measured faster than SDPA's grouped heads; a longer
# prefill keeps SDPA's causal kernels, even with it there (docs/journal.md, "Folded attention").
FOLD_TOKENS = 16


def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, H, T, D] -> [B, kv_heads, G x T, D], G = H / kv_heads: the G query heads that read
    one KV head become G x T queries of that head (query j x T + t is head j's token t). Attention
    is then one plain product per KV head; SDPA with enable_gqa on a CPU instead copies every key
    and value G times (math kernel, with a mask) or runs a kernel made for long queries, which for
    a decode step's attention costs several times more (FOLD_TOKENS)."""
    B, H, T, D = q.shape
    return q.reshape(B, kv_heads, H // kv_heads * T, D)


def folded_mask(pos: torch.Tensor, n_keys: int, groups: int, plain_decode: bool) -> torch.Tensor | None:
    """The mask of folded queries [B, 1, groups x T, n_keys]: key j visible to the query at
    position p iff j <= p, repeated for each head of a group. None where every key is visible (a
    decode step of rows that all end at the last key)."""
    if plain_decode:
        return None
    keys = torch.arange(n_keys, device=pos.device)
    return (keys[None, None, :] <= pos[:, :, None])[:, None].repeat(1, 1, groups, 1)


class Runner:
    def __init__(
        self,
        model,
        n_slots: int = 8,
        capacity: int | None = None,
        tp_group=None,
        *,
        budget_bytes: int | None = None,
        budget_tokens: int | None = None,
        block_size: int = 16,
        max_seqs: int | None = None,
        capture: str = "auto",
        prefix_cache: bool = False,
    ):
        """n_slots: sequences held at once (idle ones past it are evicted, least recently used
        first; max_seqs overrides). KV cache budget: budget_bytes or budget_tokens (e.g. from
        kv_cache.budget_from_device), allocated now; by default n_slots x DEFAULT_SEQ_TOKENS
        tokens, allocated as needed from n_slots x `capacity` tokens (DEFAULT_INITIAL_TOKENS when
        not given) on (on a GPU, the whole budget now: grown_from). `capacity` keeps its old
        meaning: a starting size, not a limit. capture: "auto" (CUDA graphs for one-token forwards
        on a GPU without TP), "on", "off" (graphs.capture_mode). prefix_cache: sequences with the same
        token prefix share its full blocks (kv_cache.py)."""
        cfg = model.config
        self.model, self.cfg, self.tp_group = model, cfg, tp_group
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads = cfg.num_attention_heads // tp
        self.kv_heads = cfg.num_key_value_heads // tp
        self.layers = model.model.layers
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        # Grouped KV heads on a CPU: short forwards fold their query heads (fold_queries). A GPU
        # keeps SDPA's kernels: folding has not been timed there (docs/GPU.md).
        self.fold = self.device.type == "cpu" and self.n_heads != self.kv_heads and self.n_heads % self.kv_heads == 0
        initial = None
        if budget_bytes is None and budget_tokens is None:
            budget_tokens = n_slots * DEFAULT_SEQ_TOKENS
            initial = grown_from(self.device, n_slots * (capacity or DEFAULT_INITIAL_TOKENS))
        self.cache = KVCache(
            len(self.layers),
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
            budget_bytes=budget_bytes,
            budget_tokens=budget_tokens,
            block_size=block_size,
            max_seqs=max_seqs or n_slots,
            initial_tokens=initial,
            prefix_cache=prefix_cache,
        )
        self.vocab_size = cfg.vocab_size
        # One-token forwards replayed from CUDA graphs where that applies (graphs.capture_mode).
        self.graphs = DecodeGraphs(self) if capture_mode(self.device, capture, tp) == "graphs" else None

    def _all_reduce(self, x):
        if self.tp_group is not None:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def _io(self, seqs: list[int], starts: torch.Tensor, pos: torch.Tensor, n_new: int, n_keys: int):
        """How this forward writes and reads the pool: a slice when it can, else through the block table."""
        cache = self.cache
        n_blocks = cdiv(n_keys, cache.block_size)
        base = cache.run_start(seqs[0], n_blocks) if len(seqs) == 1 else None
        if base is not None:
            return SliceIO(base, int(starts[0]), n_new, n_keys)
        table = cache.block_table(seqs, n_blocks).to(self.device, non_blocking=True)
        return GatherIO(table, pos, cache.block_size, n_keys)

    def layers_forward(self, input_ids, pos, io, mask, is_causal: bool) -> torch.Tensor:
        """Hidden states [B, T, hidden] after every layer (before the final norm): input_ids [B, T]
        at positions pos [B, T], the cache written and read through io. Shapes in, shapes out, no
        host sync: graphs.py captures it as it is."""
        B, T = input_ids.shape
        cache = self.cache
        fold = self.fold and T <= FOLD_TOKENS
        if fold:
            mask = folded_mask(pos, io.n_keys, self.n_heads // self.kv_heads, mask is None and T == 1)
        x = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.model.rotary_emb(x, pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(B, T, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            io.write(cache.k[i], k.transpose(1, 2).reshape(B * T, self.kv_heads, self.head_dim).to(cache.dtype))
            io.write(cache.v[i], v.reshape(B * T, self.kv_heads, self.head_dim).to(cache.dtype))
            keys, values = io.read(cache.k[i]), io.read(cache.v[i])  # [B, n_keys, kv_heads, head_dim]
            keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
            if fold:
                q = fold_queries(q, self.kv_heads)  # [B, kv_heads, G x T, head_dim]
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
                o = o.view(B, self.n_heads, T, self.head_dim)
            else:
                o = F.scaled_dot_product_attention(
                    q,
                    keys,
                    values,
                    attn_mask=mask,
                    is_causal=is_causal,
                    scale=attn.scaling,
                    enable_gqa=self.n_heads != self.kv_heads,
                )
            o = attn.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
            x = x + self._all_reduce(o)
            x = x + self._all_reduce(layer.mlp(layer.post_attention_layernorm(x)))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x)).float()

    @torch.inference_mode()
    def forward(self, slots, starts, input_ids, logits_at="all"):
        """input_ids [B, T] written at positions starts[b] + t of cache sequence slots[b] (from
        cache.plan, which gave it the blocks for its real tokens).

        logits_at: "all" -> logits [B, T, V]; None -> no logits (a prefill that only fills the
        cache); a LongTensor [B, n] -> logits [B, n, V] at those positions of each row.
        """
        dev = self.device
        seqs = slots.tolist() if torch.is_tensor(slots) else list(slots)
        starts = torch.as_tensor(starts).cpu()
        input_ids = input_ids.to(dev)
        B, T = input_ids.shape
        if self.graphs is not None and self.graphs.takes(B, T, starts, logits_at):
            out = self.graphs.run(seqs, starts, input_ids)
            if out is not None:  # None: the capture failed (logged), the eager forward follows
                return out
        n_keys = int(starts.max()) + T  # from the CPU copy: no device sync
        pos = (starts[:, None] + torch.arange(T)[None, :]).to(dev)  # [B, T]
        io = self._io(seqs, starts, pos, T, n_keys)
        x = self.layers_forward(input_ids, pos, io, *attention_mask(starts, T, n_keys, pos))
        if logits_at is None:
            return None
        if not isinstance(logits_at, str):
            x = x.gather(1, logits_at.to(dev)[:, :, None].expand(-1, -1, x.shape[-1]))
        return self.logits(x)

    def feed(self, keys: list[str], tokens: list[list[int]], tail: list[int] | None = None, logits=True, protect=()):
        """Bring each row's cache up to its tokens; returns (logits, fed), fed[b] being the number
        of tokens fed for row b. Without `tail`, logits [B, max(fed), V] of every fed position
        (right-padded); with it, logits [B, max(tail), V] of each row's last tail[b] tokens
        (left-aligned), which are fed even if the cache holds them. Raises kv_cache.KVCacheFull,
        with every cached sequence left as it was, when the blocks do not fit; idle sequences
        (not in keys or protect) may be evicted to make room."""
        limits = None if tail is None else [len(t) - n for t, n in zip(tokens, tail)]
        plans = self.cache.plan(keys, tokens, limits, protect)
        new = [toks[start:] for (_, start), toks in zip(plans, tokens)]  # O(new tokens) a row
        fed = [len(t) for t in new]
        T = max(fed)
        ids = torch.tensor([t + [0] * (T - len(t)) for t in new], dtype=torch.long)  # [B, T], right-padded
        seqs = [s for s, _ in plans]
        starts = torch.tensor([st for _, st in plans])
        logits_at = "all" if logits else None
        if logits and tail is not None:  # row b's last tail[b] tokens start at fed[b] - tail[b]
            offsets = torch.tensor([f - n for f, n in zip(fed, tail)])
            logits_at = (offsets[:, None] + torch.arange(max(tail))[None, :]).clamp(max=T - 1)
        out = self.forward(seqs, starts, ids, logits_at)
        for s, t in zip(seqs, new):  # only now: a forward that failed wrote nothing valid
            self.cache.wrote(s, t)
        return out, fed

    def catch_up(self, keys: list[str], tokens: list[list[int]], max_lag: int = 1):
        """Prefill the rows whose cache lags more than max_lag tokens behind, apart from the
        round's own forward, so that a joining sequence's prompt does not pad every other row of
        it; a short lag rides along in the round's forward instead. Lagging rows of similar lags
        prefill together (prefill_groups): newcomers that arrive together read the weights once
        (twice with the prefix cache, below). The round's other rows are protected from eviction
        meanwhile."""
        lags = [len(toks) - self.cache.valid(key, toks) for key, toks in zip(keys, tokens)]
        behind = [b for b, lag in enumerate(lags) if lag > max_lag]
        for group in prefill_groups([lags[b] for b in behind], [len(tokens[b]) for b in behind]):
            rows = [behind[i] for i in group]
            # A block joins the prefix registry only once written: with the prefix cache the
            # group's first row goes alone, so the others adopt the prompt prefix they share with
            # it (a chat template's system prompt) instead of each computing a private copy.
            parts = [rows[:1], rows[1:]] if self.cache.prefix_cache and len(rows) > 1 else [rows]
            for part in parts:
                self.feed([keys[b] for b in part], [tokens[b][:-1] for b in part], logits=False, protect=keys)

    def release(self, keys):
        self.cache.release(keys)


PREFILL_GROUP_TOKENS = 1024  # a grouped prefill's padded tokens at most (rows x longest lag)
PREFILL_GROUP_SCORES = 1 << 20  # and its attention at most this many query x key pairs
PREFILL_PADDING = 0.25  # and its padding at most this share of its tokens


def prefill_groups(
    lags: list[int],
    lengths: list[int] | None = None,
    *,
    max_tokens: int = PREFILL_GROUP_TOKENS,
    max_scores: int = PREFILL_GROUP_SCORES,
    padding: float = PREFILL_PADDING,
) -> list[list[int]]:
    """Indices into lags (tokens a row must feed), grouped for one padded prefill forward each:
    longest lag first, a row joins the open group while its padded tokens (rows x the longest
    lag) stay within max_tokens, its padding within `padding` of them, and its attention (rows x
    longest lag x longest of `lengths`, each row's whole sequence) within max_scores: rows of
    different starts take SDPA's math kernel, whose scores per head are that product (a
    one-row prefill from the start keeps the fused kernels). A row over a cap goes alone, as
    every row did before grouping. On a CPU a forward reads every weight once whatever its rows,
    so one grouped prefill costs less than a forward per row (docs/journal.md)."""
    lengths = lags if lengths is None else lengths
    order = sorted(range(len(lags)), key=lambda i: -lags[i])
    groups: list[list[int]] = []
    real = keys = 0
    for i in order:
        if groups:
            g = groups[-1]
            size = (len(g) + 1) * lags[g[0]]  # the group's longest lag is its first
            longest = max(keys, lengths[i])
            fits = size <= max_tokens and size * longest <= max_scores
            if fits and size - (real + lags[i]) <= padding * size:
                g.append(i)
                real, keys = real + lags[i], longest
                continue
        groups.append([i])
        real, keys = lags[i], lengths[i]
    return groups
