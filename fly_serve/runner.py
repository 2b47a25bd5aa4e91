"""A compact batched forward for the Llama family (Llama 3.x, Qwen2/2.5, Mistral).

Weights, norms, MLPs and rotary embeddings are the transformers model's own modules; only
attention is ours, so that the KV cache is a set of slots with per-row lengths (see kv_cache.py).
That gives each row its own positions and lets a row roll back by forgetting tokens, with no
copying and no recomputed prefix. Rows are right-padded: row b feeds `lengths[b]` real tokens;
the padding writes cache positions that stay invisible until real tokens overwrite them.

Tensor parallelism (tp.py) shards the Linear layers Megatron-style; this forward then sees
fewer heads per rank and all-reduces the two row-parallel outputs.
"""
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .kv_cache import KVCache


class Runner:
    def __init__(self, model, n_slots: int = 8, capacity: int = 256, tp_group=None):
        cfg = model.config
        self.model, self.cfg, self.tp_group = model, cfg, tp_group
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads = cfg.num_attention_heads // tp
        self.kv_heads = cfg.num_key_value_heads // tp
        self.layers = model.model.layers
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        self.cache = KVCache(len(self.layers), n_slots, self.kv_heads, self.head_dim, self.dtype, capacity,
                             self.device)
        self.vocab_size = cfg.vocab_size

    def _all_reduce(self, x):
        if self.tp_group is not None:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    @torch.inference_mode()
    def forward(self, slots, starts, input_ids, logits_at="all"):
        """input_ids [B, T] written at positions starts[b] + t of slot slots[b].

        logits_at: "all" -> logits [B, T, V]; None -> no logits (a prefill that only fills the
        cache); a LongTensor [B, n] -> logits [B, n, V] at those positions of each row.
        """
        dev = self.device
        slots, starts, input_ids = slots.to(dev), starts.to(dev), input_ids.to(dev)
        B, T = input_ids.shape
        pos = starts[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]
        n_keys = int(pos.max()) + 1
        cache = self.cache
        cache.ensure_capacity(n_keys)
        # Key j is visible to the query at position p iff j <= p.
        mask = (torch.arange(n_keys, device=dev)[None, None, :] <= pos[:, :, None])[:, None]  # [B,1,T,n_keys]
        s0 = int(slots[0])
        contiguous = bool((slots == torch.arange(s0, s0 + B, device=dev)).all())
        rows = slots[:, None].expand(B, T)

        x = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.model.rotary_emb(x, pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(B, T, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache.k[i][rows, pos] = k.transpose(1, 2).to(self.dtype)
            cache.v[i][rows, pos] = v.to(self.dtype)
            if contiguous:
                keys, values = cache.k[i][s0:s0 + B, :n_keys], cache.v[i][s0:s0 + B, :n_keys]
            else:
                keys, values = cache.k[i][slots, :n_keys], cache.v[i][slots, :n_keys]
            o = F.scaled_dot_product_attention(
                q, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
                attn_mask=mask, scale=attn.scaling, enable_gqa=self.n_heads != self.kv_heads)
            o = attn.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
            x = x + self._all_reduce(o)
            x = x + self._all_reduce(layer.mlp(layer.post_attention_layernorm(x)))
        if logits_at is None:
            return None
        if not isinstance(logits_at, str):
            x = x.gather(1, logits_at.to(dev)[:, :, None].expand(-1, -1, x.shape[-1]))
        return self.model.lm_head(self.model.model.norm(x)).float()

    def feed(self, keys: list[str], tokens: list[list[int]], tail: list[int] | None = None, logits=True):
        """Bring each row's slot up to its tokens; returns (logits, fed), fed[b] being the number
        of tokens fed for row b. Without `tail`, logits [B, max(fed), V] of every fed position
        (right-padded); with it, logits [B, max(tail), V] of each row's last tail[b] tokens
        (left-aligned), which are fed even if the slot holds them."""
        limits = [None] * len(keys) if tail is None else [len(t) - n for t, n in zip(tokens, tail)]
        plans = [self.cache.plan(key, toks, lim) for key, toks, lim in zip(keys, tokens, limits)]
        fed = [len(toks) - start for (_, start), toks in zip(plans, tokens)]
        T = max(fed)
        ids = torch.zeros(len(keys), T, dtype=torch.long)
        for b, ((slot, start), toks) in enumerate(zip(plans, tokens)):
            ids[b, :fed[b]] = torch.tensor(toks[start:])
            self.cache.wrote(slot, toks[start:])
        slots = torch.tensor([s for s, _ in plans])
        starts = torch.tensor([st for _, st in plans])
        logits_at = "all" if logits else None
        if logits and tail is not None:  # row b's last tail[b] tokens start at fed[b] - tail[b]
            offsets = torch.tensor([f - n for f, n in zip(fed, tail)])
            logits_at = (offsets[:, None] + torch.arange(max(tail))[None, :]).clamp(max=T - 1)
        return self.forward(slots, starts, ids, logits_at), fed

    def catch_up(self, keys: list[str], tokens: list[list[int]], max_lag: int = 1):
        """Prefill, one row at a time, the rows whose slot lags more than max_lag tokens behind,
        so that a joining sequence's prompt does not pad every other row of the round's forward;
        a short lag rides along in the round's own forward instead."""
        for key, toks in zip(keys, tokens):
            if len(toks) - self.cache.valid(key, toks) > max_lag:
                self.feed([key], [toks[:-1]], logits=False)

    def release(self, keys):
        self.cache.release(keys)
