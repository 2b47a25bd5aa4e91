"""Load what a deployment needs by name. "tiny:N" names a tiny random model (seed N) with the
byte-level tiny tokenizer, so that tests start replicas in seconds; any other name goes to
fly_serve.weights (the embedded default pair, a local path or a hub id)."""
from types import SimpleNamespace

import torch

from fly_serve import weights
from fly_serve.pair import eos_ids, load_drafter, load_target, place

TINY = "tiny:"


def is_tiny(name: str) -> bool:
    return name.startswith(TINY)


def target_model(name: str, dtype: str = "bf16", rank: int = 0, world: int = 1):
    """This rank's shard of the target, sharded on the CPU before it moves to the GPU."""
    if is_tiny(name):
        return place(weights.tiny_model(int(name[len(TINY):])), rank, world)
    return load_target(name, dtype, rank, world)


def drafter_model(name: str, precision: str = "int8"):
    if is_tiny(name):
        return weights.tiny_model(int(name[len(TINY):]))
    return load_drafter(name, precision)


def tokenizer(name: str):
    return weights.tiny_tokenizer() if is_tiny(name) else weights.load_tokenizer(name)


def model_config(name: str):
    """The target's config without loading weights (context length, eos)."""
    if is_tiny(name):
        return weights.tiny_model(int(name[len(TINY):])).config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(weights.resolve(name))


def stop_ids(name: str, tok) -> set[int]:
    """EOS ids of the target: its generation config plus the tokenizer's (no weights loaded)."""
    if is_tiny(name):
        gen = weights.tiny_model(int(name[len(TINY):])).generation_config
    else:
        from transformers import GenerationConfig
        try:
            gen = GenerationConfig.from_pretrained(weights.resolve(name))
        except OSError:
            gen = None
    return eos_ids(SimpleNamespace(generation_config=gen), tok)


def set_threads(n: int | None):
    """Torch threads of this process; Ray sets OMP_NUM_THREADS=1 for fractional-CPU actors."""
    if n:
        torch.set_num_threads(n)
