"""The model drafter's two loops (drafters.draft_loop): the MLA loop and the fixed-shape loop
(fixed_loop.py). Same contract, same drafts: greedy drafts equal the MLA loop's without
proposals, sampled drafts are the same keyed draws and follow the drafter's q, and an engine on
either loop gives the same outputs (tiny random models, fp32)."""

import os

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.contracts import Row
from fly_serve.decision.sampling import probs
from fly_serve.drafting.drafters import ModelDrafter, draft_loop
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer
from fly_serve.runtime.runner import Runner

DEVICE = os.environ.get("FLY_TEST_DEVICE", "cpu")
TARGET = tiny_model(seed=0, initializer_range=0.2).to(DEVICE)
DRAFTER = tiny_model(seed=1, num_hidden_layers=1, initializer_range=0.2).to(DEVICE)
PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13, 21)]
LOOPS = ("mla", "fixed")


def two_calls(loop: str, ks=((1, 4, 8, 5), (3, 6, 2, 5)), **row) -> tuple[list, list]:
    """Drafts of two calls on one drafter: fresh rows (prefill), then rows that kept some drafts
    and a token of their own (a rollback and a lag of several tokens)."""
    drafter = ModelDrafter(Runner(DRAFTER, n_slots=8), loop=loop)
    first = drafter.propose([Row(f"r{i}", p, k, mla=False, **row) for i, (p, k) in enumerate(zip(PROMPTS, ks[0]))])
    grown = [p + first.tokens[i][:2] + [9] for i, p in enumerate(PROMPTS)]
    second = drafter.propose([Row(f"r{i}", p, k, mla=False, **row) for i, (p, k) in enumerate(zip(grown, ks[1]))])
    assert first.q == second.q == [None] * 4  # keyed draws: the target compares tokens, no q travels
    assert [len(d) for d in first.tokens] == list(ks[0]) or row.get("min_confidence")
    return first.tokens + second.tokens, [first.forwards, second.forwards]


@pytest.mark.parametrize("row", [{}, dict(temperature=0.8, seed=3), dict(temperature=1.0, top_p=0.7, seed=4)])
def test_the_fixed_loop_drafts_what_the_mla_loop_drafts_without_proposals(row):
    mla, mla_forwards = two_calls("mla", **row)
    fixed, fixed_forwards = two_calls("fixed", **row)
    assert fixed == mla and fixed_forwards == mla_forwards == [8, 6]


def test_the_confidence_stop_is_the_same_on_the_device():
    """Rows with a floor stop together (drafters.stopping): the fixed loop's device mask keeps
    the same drafts, though its steps run on (a fixed shape) where the MLA loop's end."""
    mla, mla_forwards = two_calls("mla", min_confidence=0.3)
    fixed, fixed_forwards = two_calls("fixed", min_confidence=0.3)
    assert fixed == mla and any(len(d) < k for d, k in zip(mla, (1, 4, 8, 5, 3, 6, 2, 5)))
    assert fixed_forwards == [8, 6] and mla_forwards[0] < 8


@pytest.mark.parametrize("loop", LOOPS)
def test_sampled_drafts_follow_the_drafters_q(loop):
    """The first draft of many rows (one seed each, one context) is distributed as the drafter's
    processed distribution there, q (a keyed draw: sampling.keyed_draw)."""
    n, temperature, context = 2000, 0.7, PROMPTS[2]
    runner = Runner(DRAFTER, n_slots=250)
    drafter = ModelDrafter(runner, loop=loop)
    logits, _ = Runner(DRAFTER, n_slots=1).feed(["q"], [context], tail=[1])
    q = probs(logits[0, 0, :259], temperature)
    first = []
    for lo in range(0, n, 250):
        rows = [Row(f"s{s}", context, 1, mla=False, temperature=temperature, seed=s) for s in range(lo, lo + 250)]
        first += [d[0] for d in drafter.propose(rows).tokens]
        drafter.release([r.key for r in rows])
    freq = torch.bincount(torch.tensor(first), minlength=q.numel()).float() / n
    sigma = (q * (1 - q) / n).sqrt()
    assert ((freq - q).abs() <= 4.5 * sigma + 0.002).all(), (freq - q).abs().max()
    assert q.max() > 0.05  # a distribution with some shape, not a near-uniform one


def engine(loop: str, **kw):
    eng = build_engine(TARGET, DRAFTER, tokenizer=tiny_tokenizer(), max_model_len=256, draft_loop=loop, **kw)
    eng.eos_ids = set()
    return eng


def outputs(loop: str, params: dict, prompts=PROMPTS) -> list[list[int]]:
    return [r.generated for r in engine(loop).generate(prompts, dict(max_tokens=24, **params))]


AR = outputs("mla", dict(mode="ar"))


@pytest.mark.parametrize(
    "params",
    [
        dict(mode="spd", k=6),
        dict(mode="fly", k=5, theta=1.0),
        dict(mode="spd", k="auto"),
        dict(mode="spd", k=3, mla=False),
    ],
)
def test_an_engine_on_the_fixed_loop_equals_ar(params):
    assert outputs("fixed", params) == AR


def test_loose_decisions_agree_across_loops():
    """FLy (theta 0) keeps mismatches; the drafts, hence the outputs, are the same on both loops
    where the MLA loop carries no proposals."""
    params = dict(mode="fly", k=5, theta=0.0, window=1, mla=False)
    assert outputs("fixed", params) == outputs("mla", params)
    sampled = dict(params, temperature=0.9, seed=11)
    assert outputs("fixed", sampled) == outputs("mla", sampled)


def test_constrained_and_peeking_rows_take_the_mla_loop_beside_fixed_rows():
    """A grammar's masks need the host at every step, a draft-ahead row peeks: they go through the
    MLA loop, the other rows of the same call through the fixed loop."""
    eng = engine("fixed")
    params = [dict(mode="spd", k=4, regex="[0-9]{6}"), dict(mode="spd", k=4), dict(mode="spd", k=2)]
    reqs = eng.generate(PROMPTS[:3], [dict(p, max_tokens=12) for p in params])
    plain = engine("mla").generate(PROMPTS[:3], [dict(p, max_tokens=12) for p in params])
    assert [r.generated for r in reqs] == [r.generated for r in plain]
    assert reqs[0].text.isdigit() and len(reqs[0].text) == 6


def test_the_loop_is_chosen_by_device_and_the_knob_overrides():
    runner = Runner(DRAFTER, n_slots=1)
    assert draft_loop("auto", runner) == ("fixed" if runner.device.type == "cuda" else "mla")
    assert draft_loop("fixed", runner) == "fixed" and draft_loop("mla", runner) == "mla"
    with pytest.raises(ValueError, match="draft_loop"):
        draft_loop("graphs", runner)
    with pytest.raises(ValueError, match="draft_loop"):
        build_engine(TARGET, DRAFTER, tokenizer=tiny_tokenizer(), draft_loop="graphs")
    assert engine("fixed").drafters["model"].loop == "fixed"
