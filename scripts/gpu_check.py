"""The device check: the engine on a GPU at the real shapes, one JSON file out, non-zero exit on
any failed check. Needs only torch and transformers (no Ray, no install, no weights):

    PYTHONPATH=. python3 scripts/gpu_check.py                    # on cuda, results in $OUT/
    PYTHONPATH=. python3 scripts/gpu_check.py --device cpu --small   # the same checks, tiny shapes

Models are random at the real shapes (config dicts below): Qwen2.5-1.5B (target) and 0.5B
(drafter), and Llama-3-8B / Llama-3.2-1B shapes with Llama 3.1 rope scaling. Random weights give
meaningless text but real costs, and greedy decoding is still a function of the logits, so
exactness holds.

Checks (each fails the run): spd == ar in fp32 (drafter random: rejections; drafter = target:
acceptances), with and without CUDA graphs; the graph capture really ran (on cuda); every
end-to-end run finished with all its tokens.
Measured, in this order (the whole check stops starting new parts at --deadline-s):
- end to end (`end_to_end`): ar, spd k 1 / 2 / 4 / 8 / 16, fly k auto (theta 1, the cost profile
  measured on the device first) and pld at batch 1 / 8 / 16 for the 1.5B / 0.5B pair and the 8B /
  1B pair, EOS off, drafts rejected (random weights: acceptance near zero, what speculation costs
  at its worst); tok/s, ms a round, x ar, the draft loop run (fixed on cuda), a draft step against
  the drafter's graph forward, host reads a round; Hugging Face `generate` plain (each batch) and
  assisted (batch 1) as the peer; the device's copy bandwidth and the tok/s it allows plain
  decoding (weights read once a token);
- which SDPA kernel each attention case runs, forward cost of each model at 1 / 16 / 64 new
  tokens and batch 1 / 8 / 16 (eager, and graph-replayed where one token per row), the drafter /
  target cost ratio, peak memory.
Sized for one device call under 6 minutes on one H200 (--deadline-s 300 leaves the rest).
"""

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fly_bench.host_reads import HostReads, device_tensors
from fly_serve.build import build_engine
from fly_serve.k_auto.cost_calibration import measure_profile
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
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=131072, rope_scaling=dict(LLAMA31_ROPE_SCALING, factor=32.0))  # fmt: skip
PAIRS = {"qwen2.5-1.5b/0.5b": (QWEN_1_5B, QWEN_0_5B), "llama-3-8b/1b": (LLAMA_8B, LLAMA_1B)}
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


def word_tokenizer(vocab: int):
    """A tokenizer of `vocab` words ("t0" ...): the engine cuts logits to its tokenizer's size, so
    the round's vocabulary work (top-k, sampling) runs at the model's real width."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=f"t{vocab - 1}")


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


# ---- end to end
E2E_CONTEXT = 64  # prompt tokens a row; tokens generated a row: --e2e-tokens (EOS off)
E2E = {"tokens": 32, "loop": "auto"}  # the command line's
AUTO = dict(mode="fly", k="auto", k_max=15, theta=1.0, window=6)  # the served default's decoding
METHODS = {
    "ar": dict(mode="ar"),
    **{f"spd_k{k}": dict(mode="spd", k=k) for k in (1, 2, 4, 8, 16)},
    "fly_k_auto": AUTO,
    "pld": dict(mode="pld", k=8),
}


def bandwidth_gb_s(device, small: bool) -> float:
    """The device's copy bandwidth: bytes read and written by a clone of a large tensor, best of 5."""
    n = (1 << 24) if small else (1 << 28)  # 64 MB / 1 GB of fp32
    x = torch.empty(n, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        x.clone()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del x
    return round(2 * 4 * n / best / 1e9, 1)


def timed_generate(eng, prompts, params, device) -> tuple[float, list]:
    sync(device)
    t0 = time.perf_counter()
    reqs = eng.generate(prompts, [dict(params, max_tokens=E2E["tokens"])] * len(prompts))
    sync(device)
    return time.perf_counter() - t0, reqs


def hf_tok_s(model, prompts, device, assistant=None) -> float:
    """Hugging Face generate, greedy, EOS off (min_new_tokens), the whole batch: tokens / second."""
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=E2E["tokens"], min_new_tokens=E2E["tokens"], do_sample=False, pad_token_id=0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    with torch.inference_mode():
        model.generate(ids, **dict(kw, max_new_tokens=2, min_new_tokens=2))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        sync(device)
    return round(len(prompts) * E2E["tokens"] / (time.perf_counter() - t0), 2)


def quiet(*_) -> None:
    pass


def reads_per_round(eng, prompts, params) -> float:
    """Host reads of device tensors a round (fly_bench.host_reads), over 3 rounds in steady state."""
    reqs = [eng.add(p, dict(params, max_tokens=E2E["tokens"])) for p in prompts]
    for _ in range(2):
        eng.step()
    counter = HostReads(device_tensors(eng.scorer.runner, eng.drafters["model"].runner))
    with counter:
        for _ in range(3):
            eng.step()
    for r in reqs:
        eng.abort(r.id)
    return counter.count / 3


def end_to_end_pair(shapes, device, small: bool, deadline: float, drafter_graph_ms: dict) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build(shapes[0], dtype, device, small, seed=3, init=0.2)
    drafter = build(shapes[1], dtype, device, small, seed=4, init=0.2)
    vocab = target.config.vocab_size
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    # the word tokenizer has no byte decoder for the grammar library: structured output is off
    logging.getLogger("fly_serve.decision.grammar").setLevel(logging.ERROR)
    eng = build_engine(
        target,
        drafter,
        tokenizer=word_tokenizer(vocab),
        max_batch=max(BATCHES),
        max_model_len=E2E_CONTEXT + E2E["tokens"] + 64,
        kv_budget_tokens=max(BATCHES) * (E2E_CONTEXT + E2E["tokens"] + 64),
        draft_loop=E2E["loop"],
        progress=None,
    )
    eng.eos_ids = set()  # random models: every request runs to max_tokens
    t0 = time.perf_counter()
    profile = measure_profile(
        eng.scorer, eng.drafters["model"], k_max=15, max_batch=max(BATCHES), reps=2, progress=quiet
    )
    eng.policy.set_profile(profile, measured_here=True)
    out = {
        "draft_loop": eng.drafters["model"].loop,
        "target_weights_gb": round(weights / 1e9, 3),
        "calibration_s": round(time.perf_counter() - t0, 1),
    }
    gen = torch.Generator().manual_seed(5)
    for b in BATCHES:
        prompts = [torch.randint(0, vocab, (E2E_CONTEXT,), generator=gen).tolist() for _ in range(b)]
        eng.generate(prompts, [dict(mode="spd", k=16, max_tokens=4)] * b)  # graphs captured, kernels chosen
        runs = {}
        for name, params in METHODS.items():
            if time.perf_counter() > deadline:
                runs[name] = "skipped: time budget"
                continue
            wall, reqs = timed_generate(eng, prompts, params, device)
            rounds = sum(r.stats.rounds for r in reqs) / b
            draft_s = sum(r.stats.draft_s for r in reqs) / b
            runs[name] = {
                "tok_s": round(b * E2E["tokens"] / wall, 2),
                "ms_round": round(1000 * wall / rounds, 3),
                "drafted": sum(r.stats.drafted for r in reqs),
                "accepted": sum(r.stats.accepted for r in reqs),
                "complete": all(len(r.generated) == E2E["tokens"] for r in reqs),
                "draft_ms_round": round(1000 * draft_s / rounds, 3),
            }
        ar = runs.get("ar")
        for r in runs.values():
            if isinstance(r, dict) and isinstance(ar, dict):
                r["x_ar"] = round(r["tok_s"] / ar["tok_s"], 3)
        k16, graph = runs.get("spd_k16"), drafter_graph_ms.get(f"graphs_b{b}_t1_ms")
        if isinstance(k16, dict) and graph:  # a draft step (16 a round) against the drafter's replayed forward
            k16["draft_step_x_graph"] = round(k16["draft_ms_round"] / 16 / graph, 3)
        if time.perf_counter() < deadline:
            runs["hf_generate_tok_s"] = hf_tok_s(target, prompts, device)
            if b == 1:
                runs["hf_assisted_tok_s"] = hf_tok_s(target, prompts, device, assistant=drafter)
            runs["host_reads_a_round"] = {
                name: reads_per_round(eng, prompts, METHODS[name]) for name in ("ar", "spd_k8", "fly_k_auto")
            }
        out[f"b{b}"] = runs
    del eng, target, drafter
    return out


def end_to_end(device, small: bool, deadline: float, drafter_graph_ms: dict) -> dict:
    out = {"bandwidth_gb_s": bandwidth_gb_s(device, small)}
    for name, shapes in PAIRS.items():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if time.perf_counter() > deadline:
            out[name] = "skipped: time budget"
            continue
        pair = out[name] = end_to_end_pair(shapes, device, small, deadline, drafter_graph_ms.get(name, {}))
        # plain decoding reads the target's weights once a token: the most tok/s a row can get
        pair["bandwidth_tok_s_batch1"] = round(out["bandwidth_gb_s"] / pair["target_weights_gb"], 1)
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


def incomplete(e2e) -> list[str]:
    """The end-to-end runs that did not finish with all their tokens."""
    bad = []
    for pair, runs in (e2e or {}).items():
        for batch, methods in runs.items() if isinstance(runs, dict) else ():
            for name, r in methods.items() if isinstance(methods, dict) else ():
                if isinstance(r, dict) and r.get("complete") is False:
                    bad.append(f"end_to_end.{pair}.{batch}.{name}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="narrow, 2-layer models: proves the script, measures nothing")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=300.0, help="start no new part after this many seconds")
    ap.add_argument("--e2e-tokens", type=int, default=E2E["tokens"], help="tokens a row generates end to end")
    ap.add_argument("--draft-loop", default="auto", choices=("auto", "mla", "fixed"), help="the engine's draft_loop")
    a = ap.parse_args()
    E2E.update(tokens=a.e2e_tokens, loop=a.draft_loop)
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
    deadline = started + a.deadline_s
    models = {"qwen2.5-1.5b": QWEN_1_5B, "qwen2.5-0.5b": QWEN_0_5B, "llama-3-8b-rope3.1": LLAMA_8B}
    section("exactness", lambda: exactness(device, a.small))
    section("attention_kernels", lambda: kernels(device, dtype, a.small))
    # the drafters' replayed one-token forwards first: a draft step is measured against them
    section("costs.qwen2.5-0.5b", lambda: cost_of(QWEN_0_5B, device, a.small, a.reps))
    graphs = {"qwen2.5-1.5b/0.5b": result["costs.qwen2.5-0.5b"] or {}}
    section("end_to_end", lambda: end_to_end(device, a.small, deadline, graphs))
    for name, shape in models.items():
        if f"costs.{name}" in result:
            continue
        if time.perf_counter() > deadline:
            result[f"costs.{name}"] = "skipped: time budget"
            continue
        section(f"costs.{name}", lambda shape=shape: cost_of(shape, device, a.small, a.reps))
    target, drafter = result["costs.qwen2.5-1.5b"], result["costs.qwen2.5-0.5b"]
    if isinstance(target, dict) and isinstance(drafter, dict):
        result["drafter_target_ratio"] = {k: round(drafter[k] / target[k], 3) for k in target if "_t1_" in k}
    failed = [k for k, v in (result["exactness"] or {}).items() if isinstance(v, bool) and not v]
    costs = {m: result[f"costs.{m}"] for m in models if isinstance(result[f"costs.{m}"], dict)}
    failed += [f"{m}.graphs_error" for m, c in costs.items() if c.get("graphs_error")]
    failed += incomplete(result.get("end_to_end"))
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
