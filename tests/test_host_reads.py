"""Host reads of a round (fly_bench/host_reads.py): the reads of device tensors a GPU would make
the host wait for, counted on a CPU. The fixed-shape draft loop's round reads at most 3 times
(after drafting, after verifying, after deciding) at any batch and k; the MLA loop's count is
reported beside it."""

import pytest
import torch

from fly_bench.host_reads import HostReads, device_tensors
from fly_serve.build import build_engine
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer

TARGET = tiny_model(seed=0, initializer_range=0.2)
DRAFTER = tiny_model(seed=1, num_hidden_layers=1, initializer_range=0.2)
FIXED_BUDGET = 3


def test_the_counter_counts_reads_of_device_tensors_only():
    weight = torch.randn(4, 4)
    with HostReads(on_device=[weight]) as reads:
        host = torch.arange(4.0)
        host.tolist(), int(host.sum()), host.cpu()  # host tensors: nothing to wait for
        assert reads.count == 0
        y = weight @ host  # a device tensor (it reads the weights)
        y.tolist()
        float(y[0])
        back = y.cpu()  # the host copy is another tensor: reading it is free
        back.tolist()
        assert reads.count == 3 and back is not y
        moved = host.to(weight.device)  # host to device: a device tensor, no read
        assert moved is not host
        bool(moved.any())
        host[0] = y[1]  # a device value written into a host tensor: a copy to the host
        torch.zeros(2, device=weight.device).nonzero()  # made on the device, shape read back
        assert dict(reads.by_kind) == {"tolist": 1, "float": 1, "cpu": 1, "bool": 1, "copy_to_host": 1, "nonzero": 1}


def engine(loop: str, batch: int):
    eng = build_engine(
        TARGET, DRAFTER, tokenizer=tiny_tokenizer(), max_model_len=512, max_batch=batch, draft_loop=loop, progress=None
    )
    eng.eos_ids = set()
    return eng


def reads_per_round(loop: str, batch: int, params: dict, rounds: int = 4) -> list[int]:
    """Host reads of each of `rounds` rounds after the prompts' prefill."""
    eng = engine(loop, batch)
    g = torch.Generator().manual_seed(batch)
    for b in range(batch):
        eng.add(torch.randint(0, 256, (20 + 3 * b,), generator=g).tolist(), dict(params, max_tokens=200))
    eng.step()  # prefill (no logits read either: catch-up feeds without logits)
    counts = []
    for _ in range(rounds):
        with HostReads(device_tensors(eng.scorer.runner, eng.drafters["model"].runner)) as reads:
            eng.step()
        counts.append(reads.count)
    return counts


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize(
    "params",
    [
        dict(mode="spd", k=1),
        dict(mode="spd", k=4),
        dict(mode="spd", k=8, temperature=0.9, seed=3),
        dict(mode="fly", k=16, theta=0.3, rho=0.2),
        dict(mode="fly", k=8, theta=0.5, temperature=1.0, top_p=0.9, seed=4),
        dict(mode="fly", k="auto", theta=1.0),
        dict(mode="ar"),
    ],
)
def test_a_fixed_loop_round_reads_the_device_at_most_three_times(batch, params):
    counts = reads_per_round("fixed", batch, params)
    assert max(counts) <= FIXED_BUDGET, counts
    assert min(counts) >= 1  # the verdict is read: the counter sees the round's reads


def test_the_mla_loop_reads_the_device_in_every_draft_step():
    """Reported beside the fixed loop's (fly_bench.host_cost prints both): a read per drafter
    forward and more for sampled rows."""
    fixed = reads_per_round("fixed", 4, dict(mode="spd", k=8, mla=False, temperature=0.9, seed=3))
    mla = reads_per_round("mla", 4, dict(mode="spd", k=8, mla=False, temperature=0.9, seed=3))
    print(f"host reads per round, spd k 8 at T 0.9, batch 4: fixed {fixed}, mla {mla}")
    assert min(mla) > max(fixed)
