"""The one way to load a model: a name in, a ready model (or tokenizer, config, EOS ids) out.

A name is "tiny:N" or "tiny-sp:N" (a tiny random model, of the byte-level or the SentencePiece-like
tokenizer: tiny.py), an embedded default model, a local
directory or a hub id (weights.resolve). Precision: "auto" (resolve_precision), "bf16", "fp32", or "int8" (torch dynamic
quantization with per-channel weights, CPU only: a drafter's precision), quantized once and kept
in the cache (weights.converted_path), so a start loads it instead of quantizing again. int8 asked
for on a GPU resolves to bf16 (logged): torch.ao's dynamic int8 has no GPU kernels, and a profile's
drafter precision must not stop a GPU host from starting. Two precisions are llama.cpp's and a
drafter's only: "q4_0" (its GGUF requantized to Q4_0 once, gguf_requant.py) and "shipped" (the file
as it ships); on llama.cpp a drafter's "auto" means the caller's `gguf_auto` (config.py: q4_0).
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

from fly_serve.runtime import onednn_linear, tp
from fly_serve.runtime.devices import is_gpu, local_device

from .gguf_requant import faithful, requantized
from .head_cut import check_head_cut, cut_head
from .sharded_load import load_shard
from .tiny import poisoned, tiny_model, tiny_sp_tokenizer, tiny_sp_vocab_size, tiny_tokenizer
from .weights import cache_dir, converted_path, gguf_file, load_converted, resolve, resolve_meta

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GGUF_PRECISIONS = ("q4_0", "shipped")  # a drafter's on runtime llama.cpp (module docstring)
PRECISIONS = ("auto", "bf16", "fp32", "int8", *GGUF_PRECISIONS)
RUNTIMES = ("auto", "torch", "llama.cpp")
# "tiny:N": a tiny random model; "tiny:N:poison": one whose forward fails on tiny.POISON_ID, so
# that a test can send a request that fails for its own reasons (tiny.poisoned); "tiny-sp:N": one of
# the SentencePiece-like tokenizer (another model family's)
_TINY = re.compile(r"tiny(-sp)?:(\d+)(:poison)?$")


def tiny_seed(name: str) -> int | None:
    """The seed of a "tiny:N" (or "tiny-sp:N") name, else None."""
    m = _TINY.match(name) if isinstance(name, str) else None
    return int(m.group(2)) if m else None


def tiny_sp(name: str) -> bool:
    """Whether a tiny name is of the SentencePiece-like tokenizer ("tiny-sp:N")."""
    return isinstance(name, str) and name.startswith("tiny-sp:") and tiny_seed(name) is not None


def _tiny(name: str):
    """The tiny random model of a tiny name, its ids those of its tokenizer."""
    seed = tiny_seed(name)
    if tiny_sp(name):
        return tiny_model(seed, vocab_size=tiny_sp_vocab_size(), eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return tiny_model(seed)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def resolve_precision(precision: str, device: torch.device | str | None = None, progress=print) -> str:
    """The precision a model gets on `device` (default: this process's, devices.local_device).

    "auto": bf16 on a GPU or on a CPU with bf16 instructions, else fp32. Without them torch
    emulates bf16 matmuls, so a forward over T tokens costs about T one-token forwards and a
    verification of k drafts costs as much as k plain steps: speculation cannot pay
    (fly_bench/oneoff/forward_cost.py measures it; docs/journal.md).
    "int8" on a GPU: bf16, with a line to `progress` (torch.ao dynamic int8 runs on CPUs only)."""
    gpu = is_gpu(device if device is not None else local_device())
    if precision == "int8" and gpu:
        progress("precision: int8 (torch.ao dynamic quantization) is CPU-only; bf16 on this GPU")
        return "bf16"
    if precision != "auto":
        return precision
    return "bf16" if gpu or cpu_has_bf16() else "fp32"


def resolve_runtime(
    runtime: str, name, device=None, world: int = 1, progress=print, precision: str = "auto", knob: str = "precision"
) -> str:
    """The model runtime a model runs on: "torch" or "llama.cpp" (llama_runner.py).

    "auto": llama.cpp's kernels on a CPU for a model that ships as a GGUF file (the embedded pair,
    a .gguf path; a target as shipped, a drafter as load_model's gguf_auto makes it); torch
    elsewhere: on a GPU, for tensor parallelism, for an already loaded model, for safetensors
    checkpoints and for the tiny test models. Without the native part (llama-cpp-python not
    importable) "auto" says why and runs torch; asked for by name, "llama.cpp" fails with that
    reason.

    A precision asked for (`precision`, the knob `knob`, not "auto") is one llama.cpp cannot give:
    it runs a GGUF file at the file's own quantization. Under "auto" such a model runs on torch at
    that precision (a user who asks for fp32 wants fp32's numbers: torch fp32 is where strict
    decoding gives the target's own greedy text, docs/tuning.md), saying so; with "llama.cpp"
    asked for by name it is refused, naming the knob. Never one silently ignored. The GGUF
    precisions (q4_0, shipped) are the other way round: llama.cpp's only, refused on torch asked
    for by name; under "auto" on a GPU the model runs on torch at its auto precision, saying so (a
    profile's drafter precision must not stop a GPU host from starting, as int8's does not)."""
    from fly_serve.runtime import llama_runner

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime: must be one of {', '.join(RUNTIMES)} (got {runtime!r})")
    if precision in GGUF_PRECISIONS:
        if runtime == "torch" or not isinstance(name, str) or world > 1:
            raise ValueError(
                f"{knob}: {precision} is a GGUF drafter's precision on runtime llama.cpp (one process, a CPU); "
                f"use {knob} auto, int8, bf16 or fp32 on torch"
            )
        if runtime == "auto" and is_gpu(device if device is not None else local_device()):
            progress(f"{knob}: {precision} is llama.cpp's, on a CPU; on this GPU {name} runs on torch at auto")
            return "torch"
        runtime = "llama.cpp"  # asked for by its precision: refused below where it cannot run
    if runtime == "llama.cpp":
        if precision not in ("auto", *GGUF_PRECISIONS):
            raise ValueError(
                f"{knob}: runtime llama.cpp runs a GGUF file at its own quantization, so {knob} {precision} cannot "
                f"apply; use {knob} auto, or runtime torch for {precision}"
            )
        if world > 1:
            raise ValueError("runtime: llama.cpp runs one process per model; tensor parallelism needs runtime torch")
        if device is not None and is_gpu(device):
            raise ValueError("runtime: llama.cpp runs on the CPU here; a GPU needs runtime torch")
        llama_runner.lib()  # raises LlamaCppMissing, naming what is missing
        return runtime
    if runtime == "torch" or not isinstance(name, str) or world > 1 or tiny_seed(name) is not None:
        return "torch"
    if is_gpu(device if device is not None else local_device()) or gguf_file(name, progress) is None:
        return "torch"
    if not llama_runner.available():
        progress(f"runtime auto: torch, since {_missing_reason()}")
        return "torch"
    if precision != "auto":
        progress(
            f"runtime auto: torch for {name}, since {knob} {precision} was asked (llama.cpp runs a GGUF quantized)"
        )
        return "torch"
    return "llama.cpp"


def _missing_reason() -> str:
    from fly_serve.runtime import llama_runner

    try:
        llama_runner.lib()
    except llama_runner.LlamaCppMissing as e:
        return str(e)
    return "llama.cpp is available"


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
    precision: str = "auto",
    rank: int = 0,
    world: int = 1,
    progress=print,
    head_cut: int | None = None,
    device: torch.device | str | None = None,
    runtime: str = "torch",
    knob: str = "precision",
    cpu_auto: str | None = None,
    gguf_auto: str = "shipped",
):
    """The model `name` at `precision` (tiny models are always fp32), this rank's shard of
    `world`, on `device` (default: this process's, devices.local_device), in eval mode. head_cut:
    keep only the lm_head rows of ids below it and of the tokenizer's added tokens (a drafter's
    option, head_cut.py). runtime "llama.cpp" (or "auto" choosing it, resolve_runtime): a
    llama_runner.GGUFModel of the GGUF file, with precision "auto" or a GGUF precision (`knob`
    names the precision in a refusal). cpu_auto: what "auto" means for
    this model on torch on a CPU (a drafter's: int8), else resolve_precision's rule. gguf_auto: what
    "auto" means on llama.cpp (a drafter's: q4_0; a tiny model's file always runs as written); the
    GGUF precisions are a drafter's only, refused for a model whose auto is "shipped" (a target)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{knob}: must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    if precision in GGUF_PRECISIONS and gguf_auto == "shipped":
        raise ValueError(f"{knob}: {precision} applies to a draft model's GGUF file on llama.cpp; use {knob} auto")
    if resolve_runtime(runtime, name, device, world, progress, precision, knob) == "llama.cpp":
        if precision == "auto":  # a tiny model's file runs as written
            precision = f"{gguf_auto}?" if gguf_auto != "shipped" and tiny_seed(name) is None else "shipped"
        return _gguf(name, head_cut, progress, precision)
    if precision in GGUF_PRECISIONS:  # on a GPU (resolve_runtime said so): torch's own auto
        precision = "auto"
    device = torch.device(device) if device is not None else local_device()
    if precision == "auto" and cpu_auto is not None and not is_gpu(device):
        precision = cpu_auto
    precision = resolve_precision(precision, device, progress)  # before any refusal: int8 -> bf16 on a GPU
    if precision == "int8" and world > 1:
        raise ValueError("precision: int8 (torch dynamic quantization) runs on one CPU process only; use bf16")
    if check_head_cut(head_cut) is not None and world > 1:
        raise ValueError(f"head_cut: for a single-process drafter only (got world {world})")
    seed = tiny_seed(name)
    if seed is None and world > 1:  # only this rank's slices are ever read (sharded_load.py)
        return load_shard(resolve(name, progress), DTYPES[precision], rank, world, device)
    if seed is not None:
        model = _cut(_tiny(name), name, head_cut, progress)
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


def _gguf(name: str, head_cut: int | None, progress, precision: str = "shipped"):
    """The GGUF model at `precision`: "shipped", "q4_0", or "q4_0?" (a drafter's auto: the Q4_0
    form where it is faithful to the shipped file, gguf_requant.faithful)."""
    from fly_serve.runtime.llama_runner import GGUFModel

    if check_head_cut(head_cut) is not None:
        raise ValueError("head_cut: cuts a torch model's lm_head; runtime llama.cpp runs a GGUF file whole")
    path = gguf_path(name, progress)
    if precision == "q4_0":
        path = requantized(path, progress)
    elif precision == "q4_0?":
        try:
            light = requantized(path, progress)
            path = light if light == path or faithful(path, light, progress) else path
        except (OSError, RuntimeError) as e:  # a full or read-only cache: the file as shipped still runs
            progress(f"drafter: {path.name} runs as shipped: its Q4_0 form could not be made or checked ({e})")
    return GGUFModel(path)


def gguf_path(name: str, progress=print):
    """The GGUF file runtime llama.cpp runs for `name`: a tiny model's written once (tiny_gguf.py),
    else the file it ships as (weights.gguf_file); a ValueError for a model without one. Also what a
    peer given the same files reads (fly_bench/llama_server.py)."""
    seed = tiny_seed(name)
    if seed is not None:
        import transformers

        from .tiny_gguf import write_tiny_gguf

        if name.endswith(":poison"):
            raise ValueError("runtime: a poisoned tiny model is a torch module; use runtime torch")
        tag = f"torch{torch.__version__}-tf{transformers.__version__}"
        family = "tiny-sp" if tiny_sp(name) else "tiny"
        path = cache_dir() / "converted" / f"{family}-{seed}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', tag)}.gguf"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_tiny_gguf(seed, path, sp=tiny_sp(name))
        return path
    path = gguf_file(name, progress)
    if path is None:
        raise ValueError(f"runtime: llama.cpp runs GGUF files; {name!r} has none (use runtime torch)")
    return path


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
        return tiny_sp_tokenizer() if tiny_sp(name) else tiny_tokenizer()
    return AutoTokenizer.from_pretrained(resolve_meta(name, progress))


def load_config(name: str, progress=print):
    """The model's config without its weights (context length, vocabulary width)."""
    if tiny_seed(name) is not None:
        return _tiny(name).config
    return AutoConfig.from_pretrained(resolve_meta(name, progress))


def eos_ids(name_or_model, tokenizer) -> set[int]:
    """EOS ids of a model: its generation config's plus the tokenizer's."""
    if isinstance(name_or_model, str):
        if tiny_seed(name_or_model) is not None:
            gen = _tiny(name_or_model).generation_config
        else:
            try:
                gen = GenerationConfig.from_pretrained(resolve_meta(name_or_model))
            except OSError:
                gen = None
    else:
        gen = name_or_model.generation_config
    ids = gen.eos_token_id if gen is not None else None
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
