"""Verification for a batch [B, K]: tensors in, tensors out.

Words (as in vLLM's rejection sampler, plus FLy's own):
  accepted          a draft token the target agrees with (greedy: equal to its argmax;
                    sampling: it passes the u < p/q test)
  loosely accepted  a draft token the target disagrees with that FLy keeps anyway: the target
                    was unsure there (entropy gate) and the next W positions agree (window)
  recovered         the target's token at the rejected position
  bonus             the target's extra token when no draft is rejected

Two halves, so that a remote target ships small tensors:
  score()  runs where the target's logits are: per position ok [B, K], the target's token y
           [B, K+1] (recovered token at i < K, bonus at the row's K) and the entropy h [B, K].
  decide() is FLy itself: gate and window over ok and h, all rows at once, no loop over
           positions.
Rows have their own number of drafts n[b] (padded to K); n[b] = 0 is plain decoding.
"""
import math

import torch

WINDOW_RULES = ("paper", "authors")  # paper: W positions after j; authors' code: W - 1
ENTROPIES = ("topk", "full")  # top-3 entropy in nats (authors' code); normalized full-vocab (paper)


def entropy(logits: torch.Tensor, kind: str = "topk", top_k: int = 3) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, as the gate reads it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if kind == "full":
        return -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
    top = logp.topk(min(top_k, logits.shape[-1]), dim=-1).values
    return -(top.exp() * top).sum(-1)


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution: temperature, then nucleus (top-p) filtering."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = p.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def padded(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token lists -> (tokens [B, max len] right-padded with 0, lengths [B])."""
    n = torch.tensor([len(t) for t in lists])
    out = torch.zeros(len(lists), int(n.max()) if len(lists) else 0, dtype=torch.long)
    for b, t in enumerate(lists):
        out[b, :len(t)] = torch.tensor(t, dtype=torch.long)
    return out, n


def _sample(p: torch.Tensor, generator) -> torch.Tensor:
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def score_row_sampled(logits, drafts, n, q, temperature, top_p, generator):
    """One sampling row. logits [K+1, V], drafts [K], q [n, V] or None (a one-hot proposal,
    as from prompt lookup). Returns ok [K], y [K+1]."""
    K = drafts.shape[0]
    p = probs(logits[: n + 1].cpu(), temperature, top_p)  # [n+1, V]; the generators live on the CPU
    d = drafts[:n]
    p_d = p[torch.arange(n), d]
    if q is None:
        q = torch.nn.functional.one_hot(d, p.shape[-1]).float()
    q_d = q[torch.arange(n), d]
    u = torch.rand(n, generator=generator)
    ok = torch.zeros(K, dtype=torch.bool)
    ok[:n] = u * q_d < p_d  # u < p/q without dividing by zero
    residual = (p[:n] - q).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q: any sample of p is exact
    residual = torch.where(empty, p[:n], residual)
    y = torch.zeros(K + 1, dtype=torch.long)
    if n:
        y[:n] = _sample(residual / residual.sum(-1, keepdim=True), generator)
    y[n] = _sample(p[n], generator)
    return ok, y


def score(logits, drafts, n, rows_sampled=()):
    """logits [B, K+1, V] over [pending token, d_1..d_K]; drafts [B, K]; n [B] drafts per row.

    rows_sampled: (row, q or None, temperature, top_p, generator) for rows that sample; the rest
    are greedy. Returns ok [B, K] bool and y [B, K+1] long, on the CPU (they are small).
    """
    y = logits.argmax(-1).cpu()
    ok = drafts == y[:, :-1]
    for b, q, temperature, top_p, gen in rows_sampled:
        ok[b], y[b] = score_row_sampled(logits[b], drafts[b], int(n[b]), q, temperature, top_p, gen)
    K = drafts.shape[1]
    ok &= torch.arange(K)[None, :] < n[:, None]
    return ok, y


def effective_window(window: int, rule: str = "paper") -> int:
    """Positions the window checks after a mismatch: W (paper), W - 1 (authors' code)."""
    return max(window - (rule == "authors"), 0)


def decide(ok, h, n, theta, window):
    """FLy's decision for every row at once.

    ok [B, K] (False past n), h [B, K] or None, n [B], theta [B] (>= 1: strict, standard
    speculative decoding), window [B] (positions checked, see effective_window).
    Returns accept_len [B]: drafts kept, the emitted tokens being d_1..d_a then y_a; and
    loosely [B, K], the mismatches kept.
    """
    B, K = ok.shape
    i = torch.arange(K)[None, :]
    w = window[:, None]
    # Mismatches in (i, i + w]: a prefix sum, so every position is checked at once.
    miss = torch.cat([torch.zeros(B, 1, dtype=torch.long), (~ok).long().cumsum(1)], dim=1)
    end = (i + 1 + w).clamp(max=K)
    clean = (miss.gather(1, end) - miss[:, 1:]) == 0
    fits = i + w < n[:, None]  # the window lies inside this round's drafts (j + W <= K)
    unsure = torch.zeros_like(ok) if h is None else (h >= theta[:, None]) & (theta[:, None] < 1)
    deferred = ~ok & unsure & clean & fits
    stop = (~ok & ~deferred) | (i >= n[:, None])
    stop = torch.cat([stop, torch.ones(B, 1, dtype=torch.bool)], dim=1)
    accept_len = stop.int().argmax(1)  # first stop
    loosely = ~ok & (i < accept_len[:, None])
    return accept_len, loosely
