"""The device check: the engine on a GPU at the real shapes, one JSON file out, non-zero exit on
any failed check. Needs only torch and transformers (no Ray, no install, no weights):

    PYTHONPATH=. python3 scripts/gpu_check.py                    # on cuda, results in $OUT/
    PYTHONPATH=. python3 scripts/gpu_check.py --device cpu --small   # the same checks, tiny shapes

Models are random at the real shapes (config dicts below): Qwen2.5-1.5B (target) and 0.5B
(drafter), and a Llama-3-8B shape with Llama 3.1 rope scaling. Random weights give meaningless
text but real costs, and greedy decoding is still a function of the logits, so exactness holds.

Checks (each fails the run): spd == ar in fp32 (drafter random: rejections; drafter = target:
acceptances), with and without CUDA graphs; the graph capture really ran (on cuda).
Measured: which SDPA kernel each attention case runs, forward cost of each model at 1 / 16 / 64
new tokens and batch 1 / 8 / 16 (eager, and graph-replayed where one token per row), the drafter /
target cost ratio, peak memory. Under 8 minutes on one H200.
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fly_serve.build import build_engine
from fly_serve.loading.tiny import LLAMA31_ROPE_SCALING, tiny_tokenizer
from fly_serve.runtime.graphs import DecodeGraphs
from fly_serve.runtime.runner import Runner, attention_mask

QWEN_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768)  # fmt: skip
QWEN_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=32768)  # fmt: skip
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                max_position_embeddings=131072, rope_scaling=dict(LLAMA31_ROPE_SCALING))  # fmt: skip
# --small: the same families, a few layers of a narrow width (a CPU run proving the script works)
SMALL = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, vocab_size=4096)
CONTEXT = 512  # cached tokens before each timed forward
TOKENS, BATCHES = (1, 16, 64), (1, 8, 16)


def build(shape: dict, dtype: torch.dtype, device, small: bool, seed: int, init: float = 0.02):
    """A random model of `shape` made directly on `device` (no host copy of an 8B model). init:
    the weights' std; at the usual 0.02 a tied-embedding model only echoes its last token, at 0.2
    its greedy text wanders over the vocabulary (a stronger exactness test)."""
    shape = dict(shape, initializer_range=init)
    if small:
        heads = 4 if shape["num_attention_heads"] % 4 == 0 else 2
        kv = min(shape["num_key_value_heads"], 2)
        shape |= SMALL | dict(num_attention_heads=heads, num_key_value_heads=kv)
    config = (LlamaConfig if "rope_scaling" in shape else Qwen2Config)(**shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def set_capture(runner: Runner, on: bool) -> None:
    runner.graphs = DecodeGraphs(runner) if on and runner.device.type == "cuda" else None


# ---- exactness
def exactness(device, small: bool) -> dict:
    """spd == ar, greedy, fp32: drafts rejected (a random drafter) and accepted (drafter = target),
    eager and with decode steps from CUDA graphs."""
    target = build(QWEN_1_5B, torch.float32, device, small, seed=0, init=0.2)
    drafter = build(QWEN_0_5B, torch.float32, device, small, seed=1, init=0.2)
    tok = tiny_tokenizer()  # 259 ids: both models' logits are cut to them (the engine's rule)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 64, 23, 90)]
    out = {}
    for capture in (False, True):
        for name, d in (("random_drafter", drafter), ("self_drafter", target)):
            eng = build_engine(target, d, tokenizer=tok, max_batch=4, kv_budget_tokens=4096, progress=None)
            for r in (eng.scorer.runner, eng.drafters["model"].runner):
                set_capture(r, capture)
            ar = [r.generated for r in eng.generate(prompts, dict(mode="ar", max_tokens=24))]
            spd = eng.generate(prompts, dict(mode="spd", k=8, max_tokens=24))
            key = f"{name}_{'graphs' if capture else 'eager'}"
            out[key] = ar == [r.generated for r in spd]
            out[f"{key}_accepted"] = sum(r.stats.accepted for r in spd)  # self: nearly all; random: ~0
            if capture and device.type == "cuda":
                g = eng.scorer.runner.graphs
                out[f"{key}_capture_ran"] = g.failed is None and g.replays > 0
                out[f"{key}_capture_error"] = g.failed
            out.setdefault("ar_outputs", {})[key] = ar[0][:8]
    keys = list(out["ar_outputs"])
    out["ar_same_eager_and_graphs"] = len({tuple(out["ar_outputs"][k]) for k in keys}) == 1
    del target, drafter
    return out


# ---- which attention kernel
def sdpa_kernel(q, k, v, mask, is_causal: bool) -> str:
    """The kernel PyTorch's dispatcher picks for these inputs (torch._fused_sdp_choice); for a
    CausalBias, the one its own dispatch takes (flash, then memory-efficient, else math)."""
    from torch.nn.attention.bias import CausalBias

    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, CausalBias):
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        params = SDPAParams(q, k, v, None, 0.0, True, gqa)
        if can_use_flash_attention(params):
            return "FLASH_ATTENTION"
        return "EFFICIENT_ATTENTION" if can_use_efficient_attention(params) else "MATH (materialized mask)"
    return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=None, enable_gqa=gqa)).name


def kernels(device, dtype, small: bool) -> dict:
    """The kernel of each case the compact forward meets, at the 1.5B target's head shapes."""
    heads, kv, dim = (4, 2, 32) if small else (12, 2, 128)
    cases = {
        "decode_equal_lengths": ([700, 700], 1),
        "decode_ragged_batch": ([700, 300], 1),
        "verify_batch1": ([700], 9),
        "prefill_from_0": ([0], 512),
        "verify_ragged_batch": ([700, 300], 9),
    }
    out = {}
    for name, (starts, T) in cases.items():
        starts = torch.tensor(starts)
        n_keys = int(starts.max()) + T
        pos = (starts[:, None] + torch.arange(T)[None, :]).to(device)
        mask, is_causal = attention_mask(starts, T, n_keys, pos)
        B = len(starts)
        q = torch.randn(B, heads, T, dim, device=device, dtype=dtype)
        k = torch.randn(B, kv, n_keys, dim, device=device, dtype=dtype)
        out[name] = sdpa_kernel(q, k, k, mask, is_causal)
    return out


# ---- costs
def forward_ms(runner: Runner, batch: int, new: int, reps: int) -> float:
    """Median time of one forward of `new` tokens per row after CONTEXT cached ones (fed again
    each time through `tail`, so every rep does the same work)."""
    keys = [f"r{b}" for b in range(batch)]
    rows = [[(b * 31 + t) % 200 for t in range(CONTEXT + new)] for b in range(batch)]
    runner.feed(keys, [r[:CONTEXT] for r in rows], logits=False)
    times = []
    for i in range(reps + 2):  # two warm-ups: kernel choice, graph capture
        sync(runner.device)
        t0 = time.perf_counter()
        runner.feed(keys, rows, tail=[new] * batch)
        sync(runner.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    runner.release(keys)
    return round(1000 * sorted(times)[len(times) // 2], 3)


def costs(model, device, reps: int) -> dict:
    runner = Runner(model, n_slots=max(BATCHES), budget_tokens=max(BATCHES) * (CONTEXT + max(TOKENS) + 32))
    out = {}
    for capture in (False, True):
        if capture and device.type != "cuda":
            continue
        set_capture(runner, capture)
        mode = "graphs" if capture else "eager"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for b in BATCHES:
            for t in TOKENS if not capture else (1,):  # graphs replay one-token forwards only
                out[f"{mode}_b{b}_t{t}_ms"] = forward_ms(runner, b, t, reps)
        if device.type == "cuda":  # weights + KV pool + this mode's activations (and graph pools)
            out[f"{mode}_peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if capture:
            out["graphs_captured"] = len(runner.graphs.static)
            out["graphs_error"] = runner.graphs.failed
    return out


def cost_of(shape: dict, device, small: bool, reps: int) -> dict:
    gc.collect()  # the engines of earlier parts hold cycles: free their GPU memory first
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = build(shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device, small, seed=2)
    out = costs(model, device, reps)
    out["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
    del model
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="narrow, 2-layer models: proves the script, measures nothing")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; `--device cpu --small` runs the same checks on the CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "small": a.small,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    errors = {}

    def section(name: str, fn):
        """Run one part; an exception fails the run but the other parts still report."""
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported in the JSON and in the exit status
            errors[name] = f"{type(e).__name__}: {e}"
            result[name] = None
        print(f"{name}: {result[name] if name not in errors else errors[name]}", flush=True)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = {"qwen2.5-1.5b": QWEN_1_5B, "qwen2.5-0.5b": QWEN_0_5B, "llama-3-8b-rope3.1": LLAMA_8B}
    section("exactness", lambda: exactness(device, a.small))
    section("attention_kernels", lambda: kernels(device, dtype, a.small))
    for name, shape in models.items():
        section(f"costs.{name}", lambda shape=shape: cost_of(shape, device, a.small, a.reps))
    target, drafter = result["costs.qwen2.5-1.5b"], result["costs.qwen2.5-0.5b"]
    if target and drafter:
        result["drafter_target_ratio"] = {k: round(drafter[k] / target[k], 3) for k in target if "_t1_" in k}
    failed = [k for k, v in (result["exactness"] or {}).items() if isinstance(v, bool) and not v]
    failed += [f"{m}.graphs_error" for m in models if (result[f"costs.{m}"] or {}).get("graphs_error")]
    failed += [f"{name} raised" for name in errors]
    result["errors"], result["failed"] = errors, failed
    result["seconds"] = round(time.perf_counter() - started, 1)
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"failed": failed, "seconds": result["seconds"], "json": str(out_dir / "gpu_check.json")}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
