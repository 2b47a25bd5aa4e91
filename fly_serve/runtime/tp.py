"""Tensor parallelism, Megatron-style, on the transformers model's own Linear layers.

Column-parallel (split output features): q, k, v, gate, up -> each rank holds whole heads and a
slice of the MLP. Row-parallel (split input features): o, down -> each rank's output is a partial
sum, which Runner all-reduces. Embeddings, norms and lm_head stay whole on every rank.
Works over NCCL on GPUs and gloo on CPUs; the backend follows the rank's device (devices.py).
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist

from .devices import tp_backend


def _keep(linear: torch.nn.Linear, dim: int, rank: int, world: int):
    """Keep this rank's 1/world of the weight along dim (0: outputs, 1: inputs)."""
    w = linear.weight.data.chunk(world, dim=dim)[rank].contiguous()
    linear.weight = torch.nn.Parameter(w, requires_grad=False)
    linear.out_features, linear.in_features = w.shape
    if linear.bias is not None:
        if dim == 0:
            b = linear.bias.data.chunk(world)[rank].contiguous()
        else:  # a row-parallel bias is added once, after the all-reduce sums the ranks
            b = linear.bias.data if rank == 0 else torch.zeros_like(linear.bias.data)
        linear.bias = torch.nn.Parameter(b, requires_grad=False)


def shard(model, rank: int, world: int):
    """Shard `model` in place for `rank` of `world`; returns it."""
    cfg = model.config
    if cfg.num_attention_heads % world or cfg.num_key_value_heads % world:
        raise ValueError(
            f"tp_size: {world} must divide the number of attention heads "
            f"({cfg.num_attention_heads}) and of KV heads ({cfg.num_key_value_heads})"
        )
    if cfg.intermediate_size % world:
        raise ValueError(f"tp_size: {world} must divide intermediate_size ({cfg.intermediate_size})")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep(lin, 0, rank, world)
        for lin in (attn.o_proj, mlp.down_proj):
            _keep(lin, 1, rank, world)
    return model


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on addr now: a TP group's rendezvous (init_group), and the one helper the
    tools and tests use for a local server's port too (a lower layer, so all of them can import it)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def init_group(
    rank: int,
    world: int,
    addr: str = "127.0.0.1",
    port: int = 29511,
    backend: str | None = None,
    timeout_s: float = 600.0,
    device: torch.device | str = "cpu",
):
    """Join the process group of a target replica, on this rank's own `device` (devices.device_for
    of what Ray assigned it); returns the group (the default one) once a warm-up collective passed.

    backend: by default the device's (devices.tp_backend: NCCL on a GPU, gloo on the CPU).
    timeout_s bounds the rendezvous (a rank that never arrives fails the others instead of
    hanging them) and, as the group's default, every collective after it."""
    device = torch.device(device)
    backend = backend or tp_backend(device)
    if device.type == "cuda":  # NCCL binds each rank to the current device: make it this rank's own
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            init_method=f"tcp://{addr}:{port}",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    warm_up(device)
    return dist.group.WORLD


def warm_up(device: torch.device | str, group=None) -> None:
    """One all-reduce at start: NCCL builds its communicators lazily, at the first collective, so
    a broken interconnect, a duplicate GPU or a wrong backend shows here, when the replica starts,
    not at the first request. Checks the sum too (every rank adds its rank + 1)."""
    world = dist.get_world_size(group)
    x = torch.tensor([float(dist.get_rank(group) + 1)], device=device)
    dist.all_reduce(x, group=group)
    expected = world * (world + 1) / 2
    if float(x.item()) != expected:
        raise RuntimeError(f"tensor-parallel warm-up: all_reduce gave {float(x.item())}, expected {expected}")
