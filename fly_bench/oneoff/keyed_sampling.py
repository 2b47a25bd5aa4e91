"""Keyed draws (sampling.keyed_draw: the drafter and the target draw with the same numbers, a draft
is kept iff it equals the target's draw) against speculative sampling's p/q test: how often a
draft is kept, and what the sampling costs.

    python -m fly_bench.oneoff.keyed_sampling

Acceptance, per draft, on tiny pairs (the tests' varied target and drafters of growing distance:
noisy copies of it, and an unrelated model) at temperature 1 and 0.7: along the target's own
greedy text, at every position, the drafter's q and the target's p; speculative sampling keeps a
draft with probability 1 - TV(p, q), the keyed draw with the frequency measured over `--keys`
seeds. Cost: the sampling work of one verification at Qwen2.5's vocabulary (151,936), batch 1
and 8, k 8, one torch thread: the keyed draws of every row at once (sampling.probs_rows +
keyed_draw) against speculative sampling row by row (sampling.probs + speculative_row).
Nothing is asserted; JSON lines, then a markdown table.
"""

import argparse
import json
import time

import torch

from fly_serve.contracts import Row
from fly_serve.decision.sampling import RowKeys, keyed_draw, probs, probs_rows, speculative_row
from fly_serve.loading.tiny import tiny_model


def noisy_copy(model, scale: float, seed: int = 3):
    copy = tiny_model(seed=seed, initializer_range=0.2)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return copy


@torch.inference_mode()
def distributions(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """The model's processed distribution after every prefix of tokens: [len - 1, V]."""
    logits = model(torch.tensor([tokens])).logits[0, :-1, :259]
    return probs(logits, temperature)


def acceptance(target, drafter, prompt: list[int], n: int, temperature: float, keys: int) -> dict:
    with torch.inference_mode():
        text = list(prompt)
        for _ in range(n):  # the target's greedy text: the contexts drafts are made in
            text.append(int(target(torch.tensor([text])).logits[0, -1, :259].argmax()))
    p = distributions(target, text, temperature)[len(prompt) - 1 :]  # [n, V]
    q = distributions(drafter, text, temperature)[len(prompt) - 1 :]
    tv = (p - q).abs().sum(-1) / 2  # [n]
    rows = [Row(f"s{s}", [0], seed=s) for s in range(keys)]
    key = RowKeys().tensor(rows, 1, "cpu")  # [keys]
    kept = []
    for i in range(p.shape[0]):
        pos = torch.full((keys,), len(prompt) + i)
        kept.append(
            float(
                (keyed_draw(p[i].expand(keys, -1), key, pos) == keyed_draw(q[i].expand(keys, -1), key, pos))
                .float()
                .mean()
            )
        )
    kept = torch.tensor(kept)
    return {
        "speculative": round(float((1 - tv).mean()), 4),
        "keyed": round(float(kept.mean()), 4),
        "bound_low": round(float(((1 - tv) / (1 + tv)).mean()), 4),
    }


def cost_ms(batch: int, k: int, vocab: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 3
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 3, -1)
    drafts = torch.randint(0, vocab, (batch, k), generator=g)
    rows = [Row(f"r{b}", list(range(100)), k, temperature=1.0, seed=b) for b in range(batch)]
    keys = RowKeys()

    def keyed():
        p = probs_rows(logits, rows)
        pos = (torch.tensor([100] * batch)[:, None] + torch.arange(k + 1)[None, :]).reshape(-1)
        y = keyed_draw(p.reshape(-1, vocab), keys.tensor(rows, k + 1, "cpu"), pos).view(batch, k + 1)
        return y[:, :k] == drafts

    def speculative():
        for b in range(batch):
            speculative_row(probs(logits[b], 1.0), drafts[b], k, q[b], torch.Generator().manual_seed(b))

    out = {}
    for name, fn in (("keyed", keyed), ("speculative", speculative)):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_ms"] = round(1000 * best, 2)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = tiny_model(seed=0, initializer_range=0.2)
    drafters = {f"noisy {s}": noisy_copy(target, s) for s in (0.003, 0.01, 0.03)}
    drafters["unrelated"] = tiny_model(seed=1, initializer_range=0.2)
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(13)).tolist()
    lines = [
        "| drafter | T | speculative sampling (1 - TV) | keyed draws | (1 - TV) / (1 + TV) |",
        "|---|---|---|---|---|",
    ]
    for name, drafter in drafters.items():
        for temperature in (1.0, 0.7):
            row = dict(
                drafter=name,
                temperature=temperature,
                **acceptance(target, drafter, prompt, a.tokens, temperature, a.keys),
            )
            print(json.dumps(row), flush=True)
            lines.append(f"| {name} | {temperature} | {row['speculative']} | {row['keyed']} | {row['bound_low']} |")
    lines += [
        "",
        "| batch | k | keyed draws, all rows (ms) | speculative sampling, row by row (ms) |",
        "|---|---|---|---|",
    ]
    for batch in (1, 8):
        row = dict(batch=batch, k=8, vocab=a.vocab, **cost_ms(batch, 8, a.vocab, a.reps))
        print(json.dumps(row), flush=True)
        lines.append(f"| {batch} | 8 | {row['keyed_ms']} | {row['speculative_ms']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
