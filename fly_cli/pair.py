"""The flags that choose a model pair, shared by every command that loads one (generate, tune-k).
A module of its own so that main.py and tune_k.py both import it and not each other."""

import argparse

from fly_serve.loading.loading import DTYPES, PRECISIONS, RUNTIMES
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, DRAFTERS


def add_pair(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="model name, local directory or hub id")
    known = ", ".join(f"{short} ({model})" for short, model in DRAFTERS.items())
    p.add_argument(
        "--drafter",
        default=DEFAULT_DRAFTER,
        help=f"the draft model: a known drafter's name ({known}), a model name, local directory or hub id; "
        "a drafter of another tokenizer than the target's drafts through their shared vocabulary",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="target precision (auto: the GGUF as shipped on llama.cpp; on torch bf16 with hardware bf16, else fp32). "
        "bf16 or fp32 run the target on torch at that precision (llama.cpp has only the file's quantization); "
        "with --runtime llama.cpp they are refused",
    )
    p.add_argument(
        "--drafter-precision",
        choices=PRECISIONS,
        default="auto",
        help="auto: on llama.cpp the GGUF requantized to Q4_0 once where that form is faithful, int8 on torch on "
        "a CPU; q4_0 or shipped: the GGUF on llama.cpp (refused with --runtime torch); bf16, fp32 or int8 run the "
        "drafter on torch at it (refused with --runtime llama.cpp)",
    )
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="auto",
        help="model runtime (auto: llama.cpp's kernels for GGUF models on a CPU, torch elsewhere)",
    )
    p.add_argument(
        "--drafter-head-cut",
        type=int,
        default=None,
        help="cut the drafter's lm_head to the ids below this (plus the tokenizer's added tokens)",
    )
    p.add_argument(
        "--draft-min-confidence",
        type=float,
        default=0.0,
        help="stop drafting a row once the drafter's probability of its token is below this",
    )
