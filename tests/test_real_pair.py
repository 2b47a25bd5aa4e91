"""The engine on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B drafter).

Exactness checks run in fp32: bf16 kernels give a multi-token forward slightly different logits
than a one-token forward, so greedy bf16 runs of spd and ar may drift apart (docs/tuning.md)."""

import pytest

from fly_serve.build import build_engine
from fly_serve.engine.prompts import chat_prompt
from fly_serve.loading.loading import load_model, load_tokenizer
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, check_same_tokenizer

pytestmark = pytest.mark.real

QUESTIONS = [
    "Reverse a string in Python.",
    "Write a function that returns the n-th Fibonacci number, iteratively.",
    "What does `git rebase -i` do? Answer in one short sentence, please.",
    "Write a SQL query that counts orders per customer from a table orders(customer_id, id), "
    "sorted by the count, highest first.",
]


@pytest.fixture(scope="module")
def pair():
    tok = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, "fp32")
    drafter = load_model(DEFAULT_DRAFTER, "fp32")
    return tok, target, drafter, [chat_prompt(tok, q) for q in QUESTIONS]


def engine(pair, drafter=True):
    tok, target, draft, _ = pair
    return build_engine(target, draft if drafter else None, tokenizer=tok)


@pytest.fixture(scope="module")
def ar(pair):
    return [r.generated for r in engine(pair, drafter=False).generate(pair[3], dict(mode="ar", max_tokens=24))]


def test_prompts_differ_in_length(pair):
    assert len({len(p) for p in pair[3]}) == 4


@pytest.mark.parametrize("params", [dict(mode="spd", k=8), dict(mode="fly", k=8, theta=1.0)])
def test_lossless_modes_equal_ar(pair, ar, params):
    reqs = engine(pair).generate(pair[3], dict(max_tokens=24, **params))
    assert [r.generated for r in reqs] == ar
    assert sum(r.stats.tau for r in reqs) / len(reqs) > 1.5  # the real drafter does agree often


def test_fly_batched_equals_alone(pair):
    params = dict(mode="fly", k=8, window=4, theta=0.3, max_tokens=24)
    batched = engine(pair).generate(pair[3], params)
    for prompt, req in zip(pair[3][:2], batched):
        assert engine(pair).generate([prompt], params)[0].generated == req.generated


def test_tokenizers_of_the_pair_agree_and_others_are_refused(pair):
    check_same_tokenizer(pair[0], load_tokenizer(DEFAULT_DRAFTER))
    with pytest.raises(ValueError, match="^drafter:"):
        check_same_tokenizer(pair[0], load_tokenizer("tiny:0"))
