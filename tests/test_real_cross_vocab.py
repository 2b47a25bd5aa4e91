"""The real pair of two model families: the Qwen2.5-Coder 1.5B target (fp32 torch, so greedy
exactness holds) and the Gemma 3 270M drafter (its GGUF on llama.cpp's kernels, as shipped),
whose SentencePiece vocabulary of 262,144 tokens shares 95,823 token strings with the target's.
Greedy spd through it, by TLI and string-level, is the target's own greedy text."""

import pytest

from fly_serve.build import build_engine
from fly_serve.drafting.cross_vocab import CrossVocabDrafter
from fly_serve.engine.prompts import chat_prompt
from fly_serve.loading.loading import gguf_path, load_model, load_tokenizer
from fly_serve.loading.weights import DEFAULT_TARGET, GEMMA_DRAFTER
from fly_serve.runtime.llama_runner import GGUFModel

pytestmark = pytest.mark.real

QUESTIONS = [
    "Reverse a string in Python.",
    "Write a function that returns the n-th Fibonacci number, iteratively.",
    "What does `git rebase -i` do? Answer in one short sentence, please.",
]


@pytest.fixture(scope="module")
def pair():
    tok, gemma_tok = load_tokenizer(DEFAULT_TARGET), load_tokenizer(GEMMA_DRAFTER)
    target = load_model(DEFAULT_TARGET, "fp32")
    gemma = GGUFModel(gguf_path(GEMMA_DRAFTER))  # llama.cpp, the AMX rule as for every GGUF model
    engine = build_engine(target, {"gemma-270m": (gemma, gemma_tok)}, tokenizer=tok, calibrate=False)
    plain = build_engine(target, None, tokenizer=tok, calibrate=False)
    prompts = [chat_prompt(tok, q) for q in QUESTIONS]
    ar = [r.generated for r in plain.generate(prompts, dict(mode="ar", max_tokens=24))]
    return engine, prompts, ar


def test_the_gemma_map_shares_the_counted_strings(pair):
    engine, _, _ = pair
    drafter = engine.drafters["model"]
    assert isinstance(drafter, CrossVocabDrafter)
    assert drafter.vmap.n_shared == 95_823  # 95,822 token strings and the paired EOS tokens
    assert len(drafter.vmap.drafter) == 262_144


@pytest.mark.parametrize("method", ["tli", "string"])
def test_greedy_spd_through_gemma_is_the_qwen_targets_text(pair, method):
    engine, prompts, ar = pair
    reqs = engine.generate(prompts, dict(mode="spd", k=6, max_tokens=24, cross_vocab=method))
    assert [r.generated for r in reqs] == ar
    assert sum(r.stats.tau for r in reqs) / len(reqs) > 1.3  # Gemma does guess the code often
