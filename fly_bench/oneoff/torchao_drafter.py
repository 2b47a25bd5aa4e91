"""torchao vs torch.ao int8 for the drafter (issue 11): one-token cost and greedy agreement, eager mode.

    python -m fly_bench.oneoff.torchao_drafter

The default drafter in fp32, then quantized copies: torch.ao dynamic int8 per-channel (what
load_model(..., "int8") serves) and torchao's int8 weight-only, int8 dynamic-activation int8 weight
and int4 weight-only configs. Per variant: median ms of one forward token after 200 cached (20 reps
after 3 warm-ups, 2 threads), and agreement of its argmax with the fp32 drafter's at 64 positions
of a fixed code prompt, teacher-forced on the fp32 greedy continuation. A variant that raises keeps
its error text. One JSON line per variant, then a markdown table. torchao is not a dependency.
"""

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from fly_bench.prompts import CODE
from fly_serve.loading import load_model, load_tokenizer, quantize_int8, set_threads
from fly_serve.prompts import chat_prompt
from fly_serve.weights import DEFAULT_DRAFTER

CONTEXT, REPS, WARMUPS, POSITIONS = 200, 20, 3, 64


@dataclass
class Result:
    variant: str
    ms_per_token: float | None = None
    agreement: float | None = None
    error: str | None = None


def one_token_ms(model) -> float:
    """Median ms of one new token after CONTEXT cached; the cache is cropped back each rep so every
    forward sees exactly CONTEXT cached tokens."""
    context = torch.randint(0, 1000, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    model(context, past_key_values=cache, use_cache=True)
    x = torch.tensor([[42]])
    times = []
    for i in range(WARMUPS + REPS):
        t0 = time.perf_counter()
        model(x, past_key_values=cache, use_cache=True)
        if i >= WARMUPS:  # the first few warm the allocator and kernels
            times.append(time.perf_counter() - t0)
        cache.crop(-1)  # drop the token just added (transformers 5 takes only a negative count)
    return 1000 * statistics.median(times)


def argmax_at(model, seq: torch.Tensor, start: int) -> torch.Tensor:
    """Teacher-forced greedy next tokens at the POSITIONS positions from `start` of `seq`."""
    logits = model(seq, use_cache=False).logits[0, start : start + POSITIONS]
    return logits.argmax(-1)


def torchao_variant(fp32, config_name: str, **kwargs):
    """A fresh fp32 copy quantized in place by torchao (imported late: it is optional)."""
    import torchao.quantization as tq

    model = copy.deepcopy(fp32)
    tq.quantize_(model, getattr(tq, config_name)(**kwargs))
    return model


def variants(fp32) -> dict:
    """Builders by variant name; each builds its model only when measured."""
    return {
        "fp32": lambda: fp32,
        "torch.ao int8 dynamic per-channel": lambda: quantize_int8(copy.deepcopy(fp32)),
        "torchao int8 weight-only": lambda: torchao_variant(fp32, "Int8WeightOnlyConfig"),
        "torchao int8 dyn-act int8 weight": lambda: torchao_variant(fp32, "Int8DynamicActivationInt8WeightConfig"),
        "torchao int4 weight-only (plain)": lambda: torchao_variant(fp32, "Int4WeightOnlyConfig"),
        "torchao int4 weight-only (tile_packed_to_4d)": lambda: torchao_variant(
            fp32, "Int4WeightOnlyConfig", int4_packing_format="tile_packed_to_4d"
        ),
    }


def measure(name: str, build, seq: torch.Tensor, start: int, reference: torch.Tensor) -> Result:
    try:
        model = build()
        agree = (argmax_at(model, seq, start) == reference).float().mean().item()
        return Result(name, round(one_token_ms(model), 2), round(agree, 3))
    except Exception as e:  # a variant without a CPU path: keep its error and go on
        return Result(name, error=f"{type(e).__name__}: {e}"[:300])


def main() -> None:
    set_threads(2)
    torch.manual_seed(0)
    fp32 = load_model(DEFAULT_DRAFTER, "fp32")
    prompt = torch.tensor([chat_prompt(load_tokenizer(DEFAULT_DRAFTER), CODE)])
    with torch.inference_mode():
        seq = fp32.generate(prompt, max_new_tokens=POSITIONS, do_sample=False)
        start = prompt.shape[1] - 1  # logits here predict the first continuation token
        reference = argmax_at(fp32, seq, start)
        results = []
        for name, build in variants(fp32).items():
            results.append(measure(name, build, seq, start, reference))
            print(json.dumps(asdict(results[-1])), flush=True)
    print("\n| variant | ms/token | agreement | error |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.variant} | {r.ms_per_token} | {r.agreement} | {r.error or ''} |")


if __name__ == "__main__":
    main()
