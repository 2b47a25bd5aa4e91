"""What the int8 drafter's activation quantization costs in agreement, and whether a down_proj of
another kind pays it back.

  python -m fly_bench.oneoff.drafter_int8 --chats 6 --max-tokens 96 --e2e-tokens 128

torch.ao's dynamic int8 quantizes a Linear's input per tensor: one scale for every token of the
forward. Qwen2.5's MLP down_proj sees "massive activations" at a few tokens (the first, '.',
'\\n': 15-20x the median token's largest input), so a forward that holds one of them gives every
other token of it a coarse input. Variants of the engine's int8 drafter (cpu-default), only its 24
down_proj layers replaced:
  int8            as loaded (every Linear torch.ao dynamic int8, per-channel weights)
  bf16 down       down_proj in bf16
  w8 down         int8 weights, bf16 inputs (weight-only; torch's _weight_int8pack_mm)
  per-token down  int8 weights and int8 inputs with a scale per token (torch._int_mm)
and the fp32 and bf16 drafters as references. Per variant:
  agreement  the drafter's argmax against the target's on the target's own greedy text of
             `--chats` load-sweep chats (fly_bench.prompts.SWEEP_CHATS), read two ways: the whole
             sequence in one forward, and decoding (the prompt in one forward, then a token a
             forward, as a drafter runs)
  ms         one forward of 8 rows x 1 token after 200 cached (median of 9)
  rounds     the engine end to end, one row at a time, k 6, greedy: rounds, drafts and drafts kept
             over CODE and the chats (counts: no clock in them), and tokens/s (one pass)
Writes results.json and summary.md under --out.
"""

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from fly_bench.oneoff.served_vs_engine import engine_config_for
from fly_bench.prompts import CODE, SWEEP_CHATS
from fly_bench.report import write_results
from fly_bench.timing import timed
from fly_serve.build import build_engine
from fly_serve.prompts import chat_prompt
from fly_serve.weights import resolve


class Bf16Down(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.w = linear.weight.detach().bfloat16()

    def forward(self, x):
        return F.linear(x.bfloat16(), self.w).float()


def int8_rows(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 weights [out, in] and their scales [out]."""
    w = linear.weight.detach().float()
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


class W8Down(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.w, scale = int8_rows(linear)
        self.scale = scale.bfloat16()

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1]).bfloat16()  # [N, in]
        return torch.ops.aten._weight_int8pack_mm(flat, self.w, self.scale).float().reshape(*x.shape[:-1], -1)


class PerTokenDown(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w, self.scale = int8_rows(linear)
        self.wt = w.t().contiguous()  # [in, out]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        sx = flat.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127  # [N, 1]: a scale per token
        y = torch._int_mm(torch.round(flat / sx).to(torch.int8), self.wt).float() * sx * self.scale
        return y.reshape(*x.shape[:-1], -1)


DOWNS = {"bf16 down": Bf16Down, "w8 down": W8Down, "per-token down": PerTokenDown}


@torch.inference_mode()
def argmax_whole(model, seq: torch.Tensor) -> torch.Tensor:
    return model(seq[None]).logits[0].argmax(-1)  # [T]


@torch.inference_mode()
def argmax_decoding(model, seq: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """The argmax after each position from n_prompt - 1 on, fed as a drafter feeds: the prompt in
    one forward, then one token a forward (positions before are not predicted: zeros)."""
    out = model(seq[None, :n_prompt], use_cache=True)
    cache, picks = out.past_key_values, [out.logits[0, -1].argmax(-1, keepdim=True)]
    for j in range(n_prompt, len(seq) - 1):
        out = model(seq[None, j : j + 1], past_key_values=cache, use_cache=True)
        picks.append(out.logits[0, -1].argmax(-1, keepdim=True))
    return torch.cat([torch.zeros(n_prompt - 1, dtype=torch.long), *picks])


def agreement(model, texts: list[tuple[int, torch.Tensor, torch.Tensor]], decoding: bool) -> float:
    agree = total = 0
    for n_prompt, seq, target_next in texts:
        picks = argmax_decoding(model, seq, n_prompt) if decoding else argmax_whole(model, seq)
        span = slice(n_prompt - 1, len(seq) - 1)  # the generated tokens' predictions
        agree += int((picks[span] == target_next[span]).sum())
        total += len(seq) - n_prompt
    return round(agree / total, 3)


@torch.inference_mode()
def forward_ms(model, rows: int = 8, context: int = 200) -> float:
    cache = model(torch.randint(1000, (rows, context)), use_cache=True).past_key_values
    token, times = torch.randint(1000, (rows, 1)), []
    for _ in range(9):
        t0 = time.perf_counter()
        model(token, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-1)
    return round(1000 * statistics.median(times), 1)


def end_to_end(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    reqs = [r for p in prompts for r in timed(engine, [p], {"k": 6, "max_tokens": max_tokens})]
    drafted, kept = sum(r.drafted for r in reqs), sum(r.accepted for r in reqs)
    return {
        "rounds": sum(r.rounds for r in reqs),
        "drafted": drafted,
        "kept_per_draft": round(kept / max(drafted, 1), 3),
        "tokens": sum(r.tokens for r in reqs),
        "tok_s": round(sum(r.tokens for r in reqs) / sum(r.wall_s for r in reqs), 2),
    }


def summary(result: dict) -> str:
    lines = [
        f"Agreement on {result['positions']} positions of the target's greedy text; 8 x 1 forward after 200 cached;"
        f" end to end: k 6, one row at a time, {result['prompts']} prompts x {result['e2e_tokens']} tokens.",
        "",
        "| drafter | agreement: whole sequence | decoding | 8 x 1 forward ms | rounds | kept / drafted | tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        e2e = v.get("end_to_end") or {}
        lines.append(
            f"| {name} | {v['whole']} | {v['decoding']} | {v['forward_ms']} | {e2e.get('rounds', '-')} |"
            f" {e2e.get('kept_per_draft', '-')} | {e2e.get('tok_s', '-')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96, help="the target's greedy text a chat")
    p.add_argument("--e2e-tokens", type=int, default=128)
    p.add_argument("--config", default="deployments/cpu-default.yaml")
    p.add_argument("--out", default="bench_out/drafter_int8")
    args = p.parse_args()
    # no prefix cache: a prompt's drafter KV made by one variant must not serve the next
    config = replace(engine_config_for(args.config, tiny=False), prefix_cache=False)
    engine = build_engine(config.target, config.drafter, config=config, calibrate=False)
    target, drafter = engine.scorer.runner.model, engine.drafters["model"].runner.model
    chats = [chat_prompt(engine.tokenizer, c) for c in SWEEP_CHATS[: args.chats]]
    texts = []
    with torch.inference_mode():
        for ids in chats:
            seq = target.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)[0]
            texts.append((len(ids), seq, argmax_whole(target, seq)))
    fp32 = AutoModelForCausalLM.from_pretrained(resolve(config.drafter), dtype=torch.float32).eval()
    layers = drafter.model.layers
    loaded = [layer.mlp.down_proj for layer in layers]
    downs = {"int8": loaded} | {name: [cls(x.mlp.down_proj) for x in fp32.model.layers] for name, cls in DOWNS.items()}
    prompts = [chat_prompt(engine.tokenizer, CODE), *chats]
    engine.generate(prompts[:1], {"max_tokens": 8})  # warm-up
    variants = {}
    for name, modules in downs.items():
        for layer, module in zip(layers, modules):
            layer.mlp.down_proj = module
        variants[name] = {
            "whole": agreement(drafter, texts, decoding=False),
            "decoding": agreement(drafter, texts, decoding=True),
            "forward_ms": forward_ms(drafter),
            "end_to_end": end_to_end(engine, prompts, args.e2e_tokens),
        }
        print(name, json.dumps(variants[name]), flush=True)
    for layer, module in zip(layers, loaded):
        layer.mlp.down_proj = module
    for name, model in (("fp32 (reference)", fp32), ("bf16 (reference)", copy.deepcopy(fp32).bfloat16())):
        variants[name] = {
            "whole": agreement(model, texts, decoding=False),
            "decoding": agreement(model, texts, decoding=True),
            "forward_ms": forward_ms(model),
        }
        print(name, json.dumps(variants[name]), flush=True)
    result = {
        "positions": sum(len(s) - n for n, s, _ in texts),
        "prompts": len(prompts),
        "e2e_tokens": args.e2e_tokens,
        "variants": variants,
    }
    write_results(args.out, result, summary(result))


if __name__ == "__main__":
    main()
