"""One copy to the host for a round's small results.

Every read of a device tensor by the host waits for the kernels queued before it (a sync). A
verdict is up to six small tensors (ok, y, top-k ids, support, entropy, plausibility); read one
by one they cost six syncs. `to_host` packs them into one int64 buffer (token ids as they are,
booleans as 0 / 1, float32 by their bits), copies that once, and unpacks on the host.
fly_bench/host_reads.py counts the reads a round makes; tests/test_host_reads.py holds the round
to its budget.
"""

import torch


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:
        return t.reshape(-1)
    if t.dtype == torch.float32:
        return t.reshape(-1).view(torch.int32).to(torch.int64)  # the bits, exactly
    return t.reshape(-1).to(torch.int64)  # bool, int32


def _back(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.int64:
        return flat.view(like.shape)
    if like.dtype == torch.float32:
        return flat.to(torch.int32).view(torch.float32).view(like.shape)
    return flat.to(like.dtype).view(like.shape)


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors (any device; int64, int32, bool or float32; None stays None) as host tensors of
    the same shapes and dtypes, through one device-to-host copy."""
    real = [t for t in tensors if t is not None]
    if not real:
        return list(tensors)
    flat = torch.cat([_as_int64(t) for t in real]) if len(real) > 1 else _as_int64(real[0])
    host = flat.cpu()
    if host is flat:  # already on the host: a copy of its own, as a device's would be
        host = host.clone()
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        n = t.numel()
        out.append(_back(host[at : at + n], t))
        at += n
    return out
