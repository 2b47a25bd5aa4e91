"""One copy to the host for a round's small results.

Every read of a device tensor by the host waits for the kernels queued before it (a sync). A
verdict is six small tensors (ok, y, top-k ids, support, entropy, plausibility); read one by
one they cost six syncs. `to_host` packs them into one float64 buffer (exact for token ids,
booleans and float32), copies that once, and unpacks on the host. fly_bench/host_reads.py counts
the reads a round makes; tests/test_host_reads.py holds the round to its budget.
"""

import torch


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors (any device, dtype bool / int / float32; None stays None) as host tensors of
    the same shapes and dtypes, through one device-to-host copy."""
    real = [t for t in tensors if t is not None]
    if not real:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in real])
    host = flat.cpu()
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        n = t.numel()
        out.append(host[at : at + n].view(t.shape).to(t.dtype))
        at += n
    return out
