"""fp32 linear layers on oneDNN with their weights packed once, where that measures faster.

torch's CPU wheel multiplies fp32 through MKL (aten addmm), which packs the weight again on every
call, and on an AMD CPU takes a slower code path. oneDNN's linear over a weight reordered once into
its blocked layout (what inductor's freezing does for a compiled CPU model) does neither, so a
verification of a few tokens costs little more than one token, which is what speculation lives on
(timings: docs/journal.md, "fp32 on oneDNN"). Machines differ (an Intel CPU's MKL may be as fast),
so `use_where_faster` times one of the model's own layers both ways at load and keeps the faster;
FLY_SERVE_LINEAR=dense|onednn overrides it.

Only fp32 models on a CPU, in one process (a tensor-parallel rank keeps nn.Linear): bf16 already
runs through oneDNN, and int8 drafters through fbgemm. The packed weight is an opaque oneDNN tensor:
nothing else may read a converted layer's weight (Runner reads the dtype from the embeddings).
A head tied to the embeddings (Qwen's) is packed too, a copy beside the embedding table: the head
is the largest single layer, so it gains the most.
"""

import os
import time

import torch
from torch import nn

ENV = "FLY_SERVE_LINEAR"
CHOICES = ("dense", "onednn")
MIN_WEIGHTS = 1 << 20  # layers smaller than this cost microseconds either way: kept dense, not timed
MARGIN = 0.9  # oneDNN must time under 0.9x of dense: near a tie, the plain layer (and the choice stays put)
ROWS = (1, 8)  # timed row counts: a decode step and a verification of a few rows or drafts
BATCH_HINT = 8  # rows oneDNN lays the weight out for (1 to 300 rows measured alike with 8 or 64)


class PackedLinear(nn.Module):
    """nn.Linear's forward over its weight packed for oneDNN once, at construction."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [None], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(model: nn.Module) -> int:
    """Every nn.Linear of the model replaced by its PackedLinear, in place; how many."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in linears:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(linear))
    return len(linears)


def _fastest_ms(fn, x: torch.Tensor, reps: int = 5) -> float:
    fn(x)  # warm: the first call allocates
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


@torch.inference_mode()
def timings(linear: nn.Linear) -> dict[str, list[float]]:
    """Fastest ms of this layer at each of ROWS rows, dense and packed."""
    packed = PackedLinear(linear)
    xs = [torch.randn(rows, linear.in_features, dtype=linear.weight.dtype) for rows in ROWS]
    return {"dense": [_fastest_ms(linear, x) for x in xs], "onednn": [_fastest_ms(packed, x) for x in xs]}


def fp32_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain fp32 nn.Linear layers: what a choice concerns (bf16 is oneDNN's anyway)."""
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32]


def choose(model: nn.Module, progress=print) -> str:
    """The choice, "onednn" or "dense", for this model's fp32 linear layers here (dense if it has none):
    FLY_SERVE_LINEAR if set, else dense unless oneDNN is available and times the largest layer
    under MARGIN x dense (both row counts together)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in CHOICES:
        raise ValueError(f"{ENV}: must be one of {', '.join(CHOICES)} (got {forced!r})")
    linears = fp32_linears(model)
    if not linears:
        return "dense"
    if forced == "onednn" and not available():
        raise ValueError(f"{ENV}: onednn, but this torch build has no oneDNN linear; use dense")
    if forced or not available():
        return forced or "dense"
    # the decoder's largest layer (the lm_head, a vocabulary wide, would take seconds to time;
    # a drafter's cut head keeps its rows in .proj)
    head = getattr(model, "lm_head", None)
    head = getattr(head, "proj", head)
    largest = max([m for m in linears if m is not head] or linears, key=lambda m: m.weight.numel())
    if largest.weight.numel() < MIN_WEIGHTS:
        return "dense"
    try:
        ms = timings(largest)
    except RuntimeError as e:  # a torch build whose oneDNN refuses the layer: stay dense
        progress(f"linear layers: dense (oneDNN failed: {e})")
        return "dense"
    choice = "onednn" if sum(ms["onednn"]) < MARGIN * sum(ms["dense"]) else "dense"
    rows, dense, packed = (" / ".join(f"{x:.3g}" for x in xs) for xs in (ROWS, ms["dense"], ms["onednn"]))
    progress(
        f"linear layers: {choice} (a {largest.out_features} x {largest.in_features} layer at {rows} rows: "
        f"{dense} ms dense, {packed} ms oneDNN)"
    )
    return choice


# The kernels this process's fp32 models run on, as chosen at load: the cost profile's cache key
# names them (cost_calibration.machine), so a profile timed on one kernel is not read back for the
# other when a start near the margin chooses differently.
chosen: set[str] = set()


def in_use() -> str:
    """The kernels chosen for this process's fp32 models ("dense", "onednn", both), or "none"."""
    return "+".join(sorted(chosen)) or "none"


def use_where_faster(model: nn.Module, progress=print) -> nn.Module:
    """The fp32 CPU model with its linear layers packed for oneDNN if `choose` says so."""
    concerned = bool(fp32_linears(model))  # before packing replaces them
    choice = choose(model, progress)
    if choice == "onednn":
        pack(model)
    if concerned:
        chosen.add(choice)
    return model
