"""Counting the reads a GPU would make the host wait for, on a CPU.

On a GPU every read of a device tensor's values by the host (`.item()`, `.tolist()`, `.cpu()`,
`int()` / `float()` / `bool()` of a tensor, `nonzero`, a device tensor copied into a host one, ...)
waits for every kernel queued before it: a round that reads the device ten times runs its
kernels in ten bursts with the host idle between them, and nothing between two reads can be
replayed as one CUDA graph. On a CPU all tensors live on the host, so `HostReads` follows which
tensors *would* live on the device and counts only the reads of those:

- device tensors: the models' weights and buffers and the KV pool (`HostReads.on_device`), a
  factory's result made with an explicit `device=`, a tensor moved with `.to(<device>)` /
  `.cuda()`, and every result of an op that takes a device tensor;
- reads: the functions in READS applied to a device tensor, a device tensor written into a host
  one (`host[i] = device_value`, `host.copy_(device)`), and `.to("cpu")`; their results are host
  tensors again.

The code base's convention, which this follows: a device-to-host copy is written `.cpu()` (or
`.tolist()` / `.item()`), a host-to-device one `.to(device)`. On a CPU `.cpu()` and `.to(device)`
return the same tensor; under the mode they return a copy, so the host copy and the device
tensor are told apart (as they are on a GPU).

    with HostReads(on_device=[*model.parameters()]) as reads:
        engine.step()
    reads.count, reads.by_kind   # e.g. 3, {"cpu": 2, "tolist": 1}
"""

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from fly_serve.decision import vocab_reads

Tensor = torch.Tensor
# Functions whose result is on the host, read off their (device) argument.
READS = {
    Tensor.item: "item",
    Tensor.tolist: "tolist",
    Tensor.cpu: "cpu",
    Tensor.numpy: "numpy",
    Tensor.__array__: "numpy",
    Tensor.__bool__: "bool",
    Tensor.__int__: "int",
    Tensor.__float__: "float",
    Tensor.__index__: "int",
    Tensor.__format__: "format",
    Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.equal: "equal",
    Tensor.equal: "equal",
    torch.masked_select: "masked_select",
    Tensor.masked_select: "masked_select",
    torch.unique: "unique",
    Tensor.unique: "unique",
    Tensor.unbind: "iterate",  # a Python loop over a tensor's first dimension
}
MOVES = {Tensor.to, Tensor.cuda}  # to the device (with a device argument)
WRITES = {Tensor.__setitem__, Tensor.copy_}  # host[...] = device: an implicit copy to the host


def _tensors(args, kwargs) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs or {}))
    return [a for a in flat if isinstance(a, torch.Tensor)]


def _names_device(args, kwargs) -> bool:
    """A .to() call that names a device (not only a dtype)."""
    if (kwargs or {}).get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args[1:])


def _names_cpu(args, kwargs) -> bool:
    wanted = (kwargs or {}).get("device") or next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
    return isinstance(wanted, str) and wanted.startswith("cpu")


class HostReads(TorchFunctionMode):
    """A TorchFunctionMode counting the host reads of device tensors (module docstring)."""

    def __init__(self, on_device=()):
        super().__init__()
        self._device = WeakIdKeyDictionary()
        self.by_kind: Counter = Counter()
        for t in on_device:
            self._device[t] = True

    def __enter__(self):
        # the engine's host shortcuts (numpy's argmax, ...) read values a GPU run keeps on the device
        self._host_paths, vocab_reads.HOST_PATHS = vocab_reads.HOST_PATHS, False
        return super().__enter__()

    def __exit__(self, *exc):
        vocab_reads.HOST_PATHS = self._host_paths
        return super().__exit__(*exc)

    def mark(self, tensors) -> None:
        """Treat these tensors as device-resident (a model's weights, a KV pool)."""
        for t in tensors:
            self._device[t] = True

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def reset(self) -> None:
        self.by_kind.clear()

    def _on(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        device_in = any(self._on(t) for t in tensors)
        if func in READS and device_in:
            self.by_kind[READS[func]] += 1
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and any(out is t for t in tensors):
                out = out.clone()  # .cpu() of a CPU tensor is itself: the host copy is another tensor
            return out
        if func in WRITES and args and not self._on(args[0]) and any(self._on(t) for t in tensors[1:]):
            self.by_kind["copy_to_host"] += 1
            return func(*args, **kwargs)
        if func is Tensor.to and device_in and _names_cpu(args, kwargs):
            self.by_kind["cpu"] += 1
            out = func(*args, **kwargs)
            return out.clone() if out is args[0] else out
        out = func(*args, **kwargs)
        moved = func in MOVES and _names_device(args, kwargs)
        made = "device" in kwargs and kwargs["device"] is not None
        if device_in or moved or made:
            if moved and not device_in and isinstance(out, torch.Tensor) and out is args[0]:
                out = out.clone()  # the device copy of a host tensor is another tensor
            flat, _ = tree_flatten(out)
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self._device[t] = True
        return out


def device_tensors(*runners) -> list[torch.Tensor]:
    """What lives on the device for these runners (runner.Runner): the model's weights and buffers
    and the KV pool's keys and values."""
    out = []
    for r in runners:
        if r is None:
            continue
        model = getattr(r, "model", None)
        if model is not None:
            out += list(model.parameters()) + list(model.buffers())
        cache = getattr(r, "cache", None)
        out += list(getattr(cache, "k", [])) + list(getattr(cache, "v", []))
    return out
