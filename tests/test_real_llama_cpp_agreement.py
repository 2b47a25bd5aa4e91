"""What the served CPU default promises, measured: strict FLy (theta 1, k auto: the cpu-default
profile's decoding) and spd on the real pair on llama.cpp, each request alone, against plain
decoding (`ar`) of the same target on the same runtime.

On torch in fp32 strict FLy and spd give the target's own greedy text exactly (test_real_pair.py).
On llama.cpp they give it only up to kernel order: a verification forward over k + 1 tokens and a
one-token decode take different kernels, whose sums differ in the last bits, so where the top two
logits nearly tie the two runs can pick different tokens and the texts part from there. So this
test reports how often the texts are equal (and where the others part), and holds a floor under
that figure rather than equality (docs/tuning.md, "What strict decoding promises")."""

import pytest

from fly_serve.build import build_engine
from fly_serve.engine.prompts import chat_prompt

pytestmark = pytest.mark.real

QUESTIONS = [
    "Reverse a string in Python.",
    "Write a function that returns the n-th Fibonacci number, iteratively.",
    "Write a Python function that checks whether a number is prime.",
    "What does `git rebase -i` do? Answer in one short sentence, please.",
    "Write a SQL query that counts orders per customer from a table orders(customer_id, id).",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a Python generator is in two sentences.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
]
MAX_TOKENS = 48
STRICT = {"fly": dict(mode="fly", k="auto", theta=1.0), "spd": dict(mode="spd", k=8)}
# equal texts at least this often: measured 6/8 (fly) and 5/8 (spd) on a 2-core EPYC (docs/tuning.md);
# other CPUs take other kernels, so the floor leaves room
FLOOR = 0.5


@pytest.fixture(scope="module")
def engine():
    engine = build_engine(runtime="llama.cpp", max_batch=1)
    assert type(engine.scorer.runner).__name__ == "LlamaRunner"  # the runtime the CPU default serves on
    return engine


@pytest.fixture(scope="module")
def prompts(engine):
    return [chat_prompt(engine.tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return [engine.generate([p], dict(mode="ar", max_tokens=MAX_TOKENS))[0].generated for p in prompts]


def parted_at(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("name", STRICT)
def test_strict_decoding_on_llama_cpp_gives_plain_decodings_text_at_least_this_often(engine, prompts, plain, name):
    outs = [engine.generate([p], dict(max_tokens=MAX_TOKENS, **STRICT[name]))[0] for p in prompts]
    parted = [parted_at(o.generated, ref) for o, ref in zip(outs, plain)]
    equal = sum(p is None for p in parted)
    print(
        f"\n[llama.cpp agreement] {name} {STRICT[name]}: text equal to plain decoding's in {equal} of {len(prompts)} "
        f"requests ({MAX_TOKENS} tokens each, alone); the others part at tokens {[p for p in parted if p is not None]}",
        flush=True,
    )
    assert all(o.stats.drafted > 0 for o in outs)  # it speculated: the forwards had several shapes
    assert equal >= FLOOR * len(prompts), parted
