"""The one way to load a model: a name in, a ready model (or tokenizer, config, EOS ids) out.

A name is "tiny:N" (a tiny random model, tiny.py), an embedded default model, a local
directory or a hub id (weights.resolve). Precision: "auto" (resolve_precision), "bf16", "fp32", or "int8" (torch dynamic
quantization with per-channel weights, CPU only: a drafter's precision), quantized once and kept
in the cache (weights.converted_path), so a start loads it instead of quantizing again. int8 asked
for on a GPU resolves to bf16 (logged): torch.ao's dynamic int8 has no GPU kernels, and a profile's
drafter precision must not stop a GPU host from starting.
The device is the caller's (devices.py: what Ray assigned), by default this process's own. A drafter
may also cut its lm_head to the ids below `head_cut` (head_cut.py). An fp32 model on a CPU gets
its linear layers packed for oneDNN where that times faster here (onednn_linear.py). A tensor-parallel rank reads
only its shard's slices from the safetensors files (sharded_load.py), so a rank's host memory is
about 1/TP of the weights.
"""

import re
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from . import onednn_linear, tp
from .devices import is_gpu, local_device
from .head_cut import check_head_cut, cut_head
from .sharded_load import load_shard
from .tiny import poisoned, tiny_model, tiny_tokenizer
from .weights import converted_path, load_converted, resolve

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRECISIONS = ("auto", "bf16", "fp32", "int8")
# "tiny:N": a tiny random model; "tiny:N:poison": one whose forward fails on tiny.POISON_ID, so
# that a test can send a request that fails for its own reasons (tiny.poisoned)
_TINY = re.compile(r"tiny:(\d+)(:poison)?$")


def tiny_seed(name: str) -> int | None:
    """The seed of a "tiny:N" name, else None."""
    m = _TINY.match(name)
    return int(m.group(1)) if m else None


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def resolve_precision(precision: str, device: torch.device | str | None = None, progress=print) -> str:
    """The precision a model gets on `device` (default: this process's, devices.local_device).

    "auto": bf16 on a GPU or on a CPU with bf16 instructions, else fp32. Without them torch
    emulates bf16 matmuls, so a forward over T tokens costs about T one-token forwards and a
    verification of k drafts costs as much as k plain steps: speculation cannot pay. Measured on a
    2-core AVX2 CPU (fly_bench/oneoff/forward_cost.py, 1.5B target, after 200 cached): 1 / 16 tokens took
    185 / 2382 ms in bf16 and 312 / 1037 ms in fp32.
    "int8" on a GPU: bf16, with a line to `progress` (torch.ao dynamic int8 runs on CPUs only)."""
    gpu = is_gpu(device if device is not None else local_device())
    if precision == "int8" and gpu:
        progress("precision: int8 (torch.ao dynamic quantization) is CPU-only; bf16 on this GPU")
        return "bf16"
    if precision != "auto":
        return precision
    return "bf16" if gpu or cpu_has_bf16() else "fp32"


def set_threads(n: int | None) -> None:
    """Torch threads of this process (Ray sets OMP_NUM_THREADS=1 in fractional-CPU actors)."""
    if n:
        torch.set_num_threads(n)


def quantize_int8(model):
    """Dynamic int8 (per-channel weights) on every Linear layer, for a drafter on the CPU. The
    drafter only proposes, so the output stays the target's."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    warnings.filterwarnings("ignore", message=".*quantize.*deprecated", category=UserWarning)
    return quantize_dynamic(model.float(), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def load_model(
    name: str,
    precision: str = "bf16",
    rank: int = 0,
    world: int = 1,
    progress=print,
    head_cut: int | None = None,
    device: torch.device | str | None = None,
):
    """The model `name` at `precision` (tiny models are always fp32), this rank's shard of
    `world`, on `device` (default: this process's, devices.local_device), in eval mode. head_cut:
    keep only the lm_head rows of ids below it and of the tokenizer's added tokens (a drafter's
    option, head_cut.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    device = torch.device(device) if device is not None else local_device()
    precision = resolve_precision(precision, device, progress)  # before any refusal: int8 -> bf16 on a GPU
    if precision == "int8" and world > 1:
        raise ValueError("precision: int8 (torch dynamic quantization) runs on one CPU process only; use bf16")
    if check_head_cut(head_cut) is not None and world > 1:
        raise ValueError(f"head_cut: for a single-process drafter only (got world {world})")
    seed = tiny_seed(name)
    if seed is None and world > 1:  # only this rank's slices are ever read (sharded_load.py)
        return load_shard(resolve(name, progress), DTYPES[precision], rank, world, device)
    if seed is not None:
        model = _cut(tiny_model(seed), name, head_cut, progress)
        if name.endswith(":poison"):
            poisoned(model)
    elif precision == "int8":
        return _int8(name, head_cut, progress)
    else:
        model = _cut(_pretrained(name, DTYPES[precision], progress), name, head_cut, progress)
    if world > 1:
        tp.shard(model, rank, world)
    elif device.type == "cpu":
        onednn_linear.use_where_faster(model, progress)  # fp32 layers only; measured here
    return model.to(device)


def _int8(name: str, head_cut: int | None, progress):
    """The int8 drafter, quantized once into the cache (weights.load_converted) when it has local weights."""

    def build():
        return quantize_int8(_cut(_pretrained(name, torch.float32, progress), name, head_cut, progress))

    path = converted_path(name, "int8" if head_cut is None else f"int8-head{head_cut}")
    return build() if path is None else load_converted(path, build, progress)


def _pretrained(name: str, dtype: torch.dtype, progress):
    model = AutoModelForCausalLM.from_pretrained(resolve(name, progress), dtype=dtype)
    return model.eval().requires_grad_(False)


def _cut(model, name: str, head_cut: int | None, progress):
    """The model with its lm_head cut below head_cut, the tokenizer's added tokens kept."""
    if head_cut is None:
        return model
    added = load_tokenizer(name, progress).added_tokens_decoder
    return cut_head(model, head_cut, always=sorted(added))


def load_tokenizer(name: str, progress=print):
    if tiny_seed(name) is not None:
        return tiny_tokenizer()
    return AutoTokenizer.from_pretrained(resolve(name, progress))


def load_config(name: str, progress=print):
    """The model's config without its weights (context length, vocabulary width)."""
    seed = tiny_seed(name)
    if seed is not None:
        return tiny_model(seed).config
    return AutoConfig.from_pretrained(resolve(name, progress))


def eos_ids(name_or_model, tokenizer) -> set[int]:
    """EOS ids of a model: its generation config's plus the tokenizer's."""
    if isinstance(name_or_model, str):
        seed = tiny_seed(name_or_model)
        if seed is not None:
            gen = tiny_model(seed).generation_config
        else:
            try:
                gen = GenerationConfig.from_pretrained(resolve(name_or_model))
            except OSError:
                gen = None
    else:
        gen = name_or_model.generation_config
    ids = gen.eos_token_id if gen is not None else None
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
