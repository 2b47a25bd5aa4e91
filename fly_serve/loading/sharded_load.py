"""Load only this tensor-parallel rank's shard, straight from the safetensors files.

Loading the whole checkpoint and then cutting it (tp.shard) makes every rank hold the full model
on the host for a while. Here the model is built on the meta device (no memory), tp.shard cuts the
meta skeleton (so the plan, its checks and its shapes are tp.py's own, not restated), and each
tensor is read with only this rank's slice of it, converted and placed, one tensor at a time.

    model = load_shard("/models/llama-70b", torch.bfloat16, rank=1, world=4, device="cuda")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from fly_serve.runtime import tp

INDEX = "model.safetensors.index.json"


def local_dir(model_dir: str | Path) -> Path:
    """A local checkpoint directory; a hub id is downloaded (weights and json only) into the hub
    cache, which every rank of a node shares: its file locks make concurrent ranks safe."""
    path = Path(model_dir).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model_dir), allow_patterns=["*.safetensors", "*.json"]))


def weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, else by listing the files)."""
    index = root / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir: no *.safetensors files in {root}")
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def skeleton(config, dtype: torch.dtype) -> PreTrainedModel:
    """The model with every parameter and buffer on the meta device: shapes, no storage."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def row_parallel(model: PreTrainedModel, rank: int, world: int) -> set[str]:
    """Shard the meta skeleton in place with tp.shard; returns the Linear layers whose inputs it
    split (row-parallel). Their outputs are partial sums, so tp.shard keeps a bias on rank 0 only."""
    full_in = {n: m.in_features for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tp.shard(model, rank, world)  # validates world against heads / KV heads / intermediate size
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features != full_in[n]}


def shard_index(full: tuple[int, ...], local: tuple[int, ...], rank: int, world: int, name: str) -> tuple[slice, ...]:
    """This rank's slice of a tensor of shape `full`, given the shape `local` tp.shard left it:
    piece `rank` of torch.chunk(world) along the one dim that shrank."""
    if len(full) != len(local):
        raise ValueError(f"{name}: checkpoint shape {full} does not fit the model's {local}")
    index = []
    for n, k in zip(full, local):
        step = -(-n // world)  # torch.chunk's piece size
        if k == n:
            index.append(slice(None))
        elif world > 1 and k == min(step, n - rank * step):
            index.append(slice(rank * step, rank * step + k))
        else:
            raise ValueError(f"{name}: checkpoint shape {full} does not fit the model's {local}")
    if sum(s != slice(None) for s in index) > 1:
        raise ValueError(f"{name}: sharded along more than one dim ({full} -> {local})")
    return tuple(index)


def read(
    file: Path, name: str, local: tuple[int, ...], rank: int, world: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's slice of tensor `name`, as an owned tensor of `dtype` on `device`."""
    # safe_open maps the whole file, and every page a slice touches stays resident until the file
    # is closed: opening it per tensor bounds that to one tensor instead of the whole checkpoint.
    with safe_open(file, framework="pt") as f:
        part = f.get_slice(name)
        view = part[shard_index(tuple(part.get_shape()), local, rank, world, name)]
        # The view points into the mapping; copy it out (a parameter must not pin the file).
        out = torch.empty(view.shape, dtype=dtype if view.is_floating_point() else view.dtype, device=device)
        out.copy_(view)
    return out


def put(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer `name` (dotted path) of `model` by `value`."""
    parent, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent)
    if leaf in dict(module.named_parameters(recurse=False)) and not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    setattr(module, leaf, value)


def tie(model: PreTrainedModel, loaded: set[str]) -> None:
    """Share the tensor of each tied pair (lm_head <-> embed_tokens when the config ties them) that
    the checkpoint stores once; transformers computed the pairs from the config at init."""
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target in loaded and source in loaded:
            continue  # stored twice: keep both as read, as from_pretrained does when they differ
        if target in loaded:  # only the other end is in the file: tie the other way round
            target, source = source, target
        if source not in loaded:
            raise KeyError(f"{target} and {source} (tied) are both missing from the checkpoint")
        put(model, target, model.get_parameter(source))


def materialize_buffers(model: PreTrainedModel, device: torch.device) -> None:
    """Rebuild on `device` each module whose non-persistent buffers were left on meta (rotary
    embeddings: inv_freq is computed in __init__ from the config, not stored in checkpoints).
    Built on the CPU, then moved, so the values are those from_pretrained computes."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if any(p.is_meta for p in module.parameters(recurse=False)):
            raise RuntimeError(f"{name}: parameters missing from the checkpoint")
        with torch.device("cpu"):
            fresh = type(module)(module.config if hasattr(module, "config") else model.config)
        model.set_submodule(name, fresh.to(device))


def load_shard(
    model_dir: str | Path, dtype: torch.dtype, rank: int = 0, world: int = 1, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """Rank `rank` of `world` of the causal LM in `model_dir` (a local directory of safetensors
    files, or a hub id), sharded exactly as tp.shard shards it, in `dtype` on `device`, in eval
    mode. Only this rank's slices are read from the files."""
    if not 0 <= rank < world:
        raise ValueError(f"rank: must be in [0, tp_size={world}) (got {rank})")
    root, device = local_dir(model_dir), torch.device(device)
    config = AutoConfig.from_pretrained(root)
    model = skeleton(config, dtype)
    rows = row_parallel(model, rank, world)
    where = weight_files(root)
    tied = getattr(model, "all_tied_weights_keys", {})  # target -> source, from the config
    loaded = set()
    for name, meta in model.state_dict(keep_vars=True).items():
        module, _, leaf = name.rpartition(".")
        local = tuple(meta.shape)
        if name not in where:
            if name in tied or name in tied.values():
                continue  # one end of a tied pair: tie() shares the other end's tensor
            raise KeyError(f"{name}: missing from the checkpoint in {root}")
        if module in rows and leaf == "bias" and rank != 0:
            value = torch.zeros(local, dtype=dtype, device=device)  # added once, by rank 0
        else:
            value = read(where[name], name, local, rank, world, dtype, device)
        put(model, name, value)
        loaded.add(name)
    tie(model, loaded)
    materialize_buffers(model, device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after loading: {left}")
    if (root / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(root)
    return model.eval().requires_grad_(False)
