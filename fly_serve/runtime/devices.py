"""Which device a process computes on: the GPUs Ray assigned it, never what happens to be visible.

Ray leaves every GPU of a node visible to an actor that asked for none, so
`torch.cuda.is_available()` says nothing about what the actor may use: two CPU ranks would both
take NCCL on cuda:0 ("Duplicate GPU detected"), and a drafter without `num_gpus` would load on a
GPU that Ray gave to another actor. The rule here is pure (ids in, a device out) so it is tested
on the CPU; a deployment passes `ray.get_gpu_ids()`, an in-process engine passes nothing and gets
`local_device()`.

    device = device_for(ray.get_gpu_ids())   # [] -> cpu; ["3"] -> the actor's GPU
    backend = tp_backend(device)             # nccl on a GPU, gloo on the CPU
"""

import os

import torch


def device_for(gpu_ids: list, visible: str | None = None) -> torch.device:
    """The device of an actor that Ray assigned `gpu_ids` (ray.get_gpu_ids(): ids or strings).

    None assigned: the CPU, whatever is visible. One or more: the first, as the process sees it.
    Ray sets CUDA_VISIBLE_DEVICES to the assigned ids, so that GPU is the process's cuda:i where
    i is its place in `visible` (CUDA_VISIBLE_DEVICES; index 0 when the variable is unset or does
    not list it, the usual case being exactly the assigned ids)."""
    if not gpu_ids:
        return torch.device("cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    order = [v.strip() for v in visible.split(",")] if visible else []
    first = str(gpu_ids[0])
    return torch.device("cuda", order.index(first) if first in order else 0)


def local_device() -> torch.device:
    """The device of a process outside Ray (the CLI, benchmarks, tests): its first GPU if any.
    FLY_DEVICE=cpu forces the CPU on a GPU host (a CPU run beside a GPU job)."""
    forced = os.environ.get("FLY_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def tp_backend(device: torch.device | str) -> str:
    """The collective backend of a tensor-parallel rank on `device`: NCCL between GPUs, gloo on the
    CPU (NCCL cannot move CPU tensors; gloo on GPU tensors would copy through the host)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def is_gpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"
