"""Reads along the vocabulary axis of logits [..., V] that every round makes, done where each is
cheapest.

- `argmax`: on the host a float32 argmax goes through numpy, whose reduction is vectorized;
  torch's CPU argmax over a 151,936-wide last axis ran 4-12x slower (docs/journal.md, "The
  round's reads of the vocabulary"). On a device the tensor stays where it is (torch's kernel).
- `top_prob`: a drafter's confidence in its token, max softmax, as exp(max - logsumexp): no
  probabilities written out (a softmax and its max took 1.7x as long here).
- `gate_entropy`: the entropy gate reads a row's entropy only at a mismatch (verify.decide: a
  deferred position is `~ok & unsure`), so on the host only mismatched positions pay a softmax
  over the vocabulary. On a device every position is computed: finding the mismatches first
  would cost a read of the device (a sync) for kernels that cost little there.

Both host shortcuts read values on the host, so fly_bench.host_reads, which counts a CPU run's
reads as a GPU's, turns them off while it counts (HOST_PATHS): the CPU then takes the device's path.
"""

import math

import numpy as np
import torch

HOST_PATHS = True  # False: every tensor takes the device's path (fly_bench.host_reads)


def _on_host(t: torch.Tensor) -> bool:
    return HOST_PATHS and t.device.type == "cpu"


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> int64 [...] on logits' device; the first index of the maximum (NaN
    counts as the maximum), as torch.argmax."""
    if _on_host(logits) and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))
    return logits.argmax(-1)


def top_prob(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the largest softmax probability [...] (float32)."""
    x = logits.float()
    return torch.exp(x.amax(-1) - torch.logsumexp(x, -1))


def entropy(p: torch.Tensor, kind: str = "topk", top_k: int = 3) -> torch.Tensor:
    """The gate's entropy of a distribution p (probabilities over the last dim): "full" is the
    entropy normalized by log V (the paper), "topk" the entropy in nats of the top-3
    probabilities (the authors' code and the vLLM port). At T > 0, p is the processed
    (tempered, top-p) distribution, as the vLLM port reads it."""
    p = p.float()
    if kind == "full":
        return -torch.special.xlogy(p, p).sum(-1) / math.log(p.shape[-1])
    top = p.topk(min(top_k, p.shape[-1]), dim=-1).values
    return -torch.special.xlogy(top, top).sum(-1)


def gate_entropy(
    logits: torch.Tensor, drafted: torch.Tensor, y: torch.Tensor, n: torch.Tensor, rows: list[int], kind: str, h
) -> None:
    """The entropy of kind `kind` (`entropy`) of rows `rows` of logits [B, K+1, V] at their
    draft positions, written into h [B, K] in place: on the host at the mismatches alone
    (drafted [B, K] != y [B, K+1]'s first K, within n [B] drafts; elsewhere h keeps its value),
    on a device at every position."""
    K = drafted.shape[1]
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    if not _on_host(logits):
        h[idx] = entropy(torch.softmax(logits[idx, :K].float(), -1), kind)
        return
    miss = (drafted[idx] != y[idx, :K]) & (torch.arange(K)[None, :] < n[idx, None])  # [R, K]
    r, i = miss.nonzero(as_tuple=True)
    if len(r):
        h[idx[r], i] = entropy(torch.softmax(logits[idx[r], i].float(), -1), kind)
