"""FLy's verification as tensors in, tensors out: vLLM's words (accepted, recovered, bonus) plus
*loosely accepted* for a mismatch FLy keeps.

`greedy_check` runs next to the target's logits; `decide` is FLy for the whole batch as [B, K]
tensor ops (a prefix sum finds clean windows, an argmax the first rejection). tests/reference.py
is a scalar Algorithm 1 that `decide` must agree with.
"""

import torch

from .vocab_reads import argmax


def padded(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token lists -> (tokens [B, max len] right-padded with 0, lengths [B])."""
    lengths = [len(t) for t in lists]
    width = max(lengths, default=0)
    if width == 0:  # an ar step
        return torch.zeros(len(lists), 0, dtype=torch.long), torch.zeros(len(lists), dtype=torch.long)
    out = torch.tensor([list(t) + [0] * (width - len(t)) for t in lists], dtype=torch.long).view(len(lists), width)
    return out, torch.tensor(lengths, dtype=torch.long)


def greedy_check(logits: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, K+1, V] over [pending token, d_1..d_K]; drafts [B, K]; n [B] drafts per row.
    Returns ok [B, K] (False past n) and the target's tokens y [B, K+1], on the CPU."""
    y = argmax(logits).cpu()
    K = drafts.shape[1]
    ok = (drafts == y[:, :-1]) & (torch.arange(K)[None, :] < n[:, None])
    return ok, y


def plausibility_from_logits(logits: torch.Tensor, drafts: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """p(d_i) / max_v p(v) under softmax(logits) (the distribution a greedy row's gate reads), as
    exp(logit of d_i - logit of the argmax y_i): two gathers, no softmax over the vocabulary.
    logits [B, K+1, V]; drafts [B, K]; y [B, K+1] (the argmax). Returns [B, K] on the logits'
    device (no host read)."""
    K = drafts.shape[1]
    at = logits[:, :K]
    own = at.gather(-1, drafts.to(at.device)[..., None]).squeeze(-1).float()
    top = at.gather(-1, y[:, :K].to(at.device)[..., None]).squeeze(-1).float()
    return torch.exp(own - top)


def plausibility_from_probs(p: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """p(d_i) / max_v p(v) for probabilities p [..., V] and drafts [...] (a sampling row's processed
    distribution). Keeps p's dtype: no rounding beyond the one division."""
    return p.gather(-1, drafts[..., None]).squeeze(-1) / p.max(-1).values


def plausible_mask(ratio: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """The plausibility guard [B, K]: a mismatch may be deferred only where the target's
    probability of the draft is at least rho times its top probability. ratio [B, K] from
    plausibility_from_*; rho [B] (0: no guard, every position passes)."""
    return ratio >= rho[:, None].to(ratio.dtype)


def window_positions(window: int, rule: str = "paper") -> tuple[int, int]:
    """(positions the window checks after a mismatch, positions it must fit in the round).

    Paper: W and W (j + W <= K). Authors' code: W - 1 checked, but the window must still end
    inside the drafts (j + W <= K)."""
    return (max(window - 1, 0) if rule == "authors" else window), window


def decide(ok, h, n, theta, check, span=None, support=None, plausible=None):
    """FLy's decision for every row at once.

    ok [B, K] (False past n); h [B, K] or None; n [B]; theta [B] (>= 1: strict, standard
    speculative decoding); check [B] positions the window checks after a mismatch; span [B]
    positions it must fit (j + span <= n; default: check); support [B, K] or None: a mismatch
    may be deferred only where the target gives the draft token p > 0; plausible [B, K] or None:
    likewise, only where the draft passes the plausibility guard (p(d) >= rho * max p, see
    `plausible_mask`).
    Returns accept_len [B]: drafts kept, the emitted tokens being d_1..d_a then y_a; and
    loosely [B, K], the mismatches kept.
    """
    B, K = ok.shape
    i = torch.arange(K)[None, :]
    if h is None or not bool((theta < 1).any()):  # every row strict: the first rejection ends it
        stop = torch.cat([~ok | (i >= n[:, None]), torch.ones(B, 1, dtype=torch.bool)], dim=1)
        return stop.int().argmax(1), torch.zeros_like(ok)
    span = check if span is None else span
    # Mismatches in (i, i + check]: a prefix sum, so every position is checked at once.
    miss = torch.cat([torch.zeros(B, 1, dtype=torch.long), (~ok).long().cumsum(1)], dim=1)
    end = (i + 1 + check[:, None]).clamp(max=K)
    clean = (miss.gather(1, end) - miss[:, 1:]) == 0
    fits = i + span[:, None] < n[:, None]  # the window lies inside this round's drafts (j + W <= K)
    unsure = torch.zeros_like(ok) if h is None else (h >= theta[:, None]) & (theta[:, None] < 1)
    deferred = ~ok & unsure & clean & fits
    if support is not None:
        deferred &= support
    if plausible is not None:
        deferred &= plausible
    stop = (~ok & ~deferred) | (i >= n[:, None])
    stop = torch.cat([stop, torch.ones(B, 1, dtype=torch.bool)], dim=1)
    accept_len = stop.int().argmax(1)  # first stop
    loosely = ~ok & (i < accept_len[:, None])
    return accept_len, loosely
