"""Build an engine from a target and a drafter: names or paths in, a ready Engine out."""
import torch

from . import tp
from .drafters import ModelDrafter
from .engine import Engine
from .params import Params
from .target import Target
from .weights import DEFAULT_DRAFTER, DEFAULT_TARGET, check_same_tokenizer, load_model, load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DRAFTER_PRECISIONS = ("bf16", "fp32", "int8")


def quantize_int8(model):
    """Dynamic int8 (per-channel weights) on every Linear layer: ~3x cheaper drafter forwards on
    this CPU. The drafter only proposes, so the output stays the target's."""
    import warnings
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    warnings.filterwarnings("ignore", message=".*quantize.*deprecated", category=UserWarning)
    return quantize_dynamic(model.float(), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def on_device(model):
    """The model on this process's GPU where there is one (Ray sets CUDA_VISIBLE_DEVICES per
    actor, so "cuda" is the actor's own GPU), else where it is."""
    return model.to("cuda") if torch.cuda.is_available() else model


def place(model, rank: int = 0, world: int = 1):
    """This rank's tensor-parallel shard, cut on the CPU, then moved to the device."""
    if world > 1:
        tp.shard(model, rank, world)
    return on_device(model)


def load_target(name: str, dtype: str = "bf16", rank: int = 0, world: int = 1, progress=print):
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(DTYPES)} (got {dtype!r})")
    return place(load_model(name, dtype=DTYPES[dtype], progress=progress), rank, world)


def load_drafter(name: str, precision: str = "int8", progress=print):
    if precision not in DRAFTER_PRECISIONS:
        raise ValueError(f"drafter_precision: must be one of {', '.join(DRAFTER_PRECISIONS)} (got {precision!r})")
    if precision == "int8":
        if torch.cuda.is_available():
            raise ValueError("drafter_precision: int8 (torch dynamic quantization) runs on the CPU only; "
                             "use bf16 on GPUs")
        return quantize_int8(load_model(name, dtype=torch.float32, progress=progress))
    return on_device(load_model(name, dtype=DTYPES[precision], progress=progress))


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def build_engine(target: str = DEFAULT_TARGET, drafter: str | None = DEFAULT_DRAFTER, dtype: str = "bf16",
                 drafter_precision: str = "int8", max_batch: int = 8, max_model_len: int = 4096,
                 defaults: Params | None = None, draft_min_confidence: float = 0.0, progress=print) -> Engine:
    tokenizer = load_tokenizer(target, progress=progress)
    target_model = load_target(target, dtype, progress=progress)
    draft = None
    if drafter:
        check_same_tokenizer(tokenizer, load_tokenizer(drafter, progress=progress))
        draft = ModelDrafter(load_drafter(drafter, drafter_precision, progress), n_slots=max_batch,
                             min_confidence=draft_min_confidence)
    max_model_len = min(max_model_len, target_model.config.max_position_embeddings)
    return Engine(Target(target_model, n_slots=max_batch), draft, tokenizer, eos_ids(target_model, tokenizer),
                  max_batch=max_batch, max_model_len=max_model_len, defaults=defaults)
