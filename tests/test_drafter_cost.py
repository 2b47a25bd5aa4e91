"""A cheaper drafter stays exact: the lm_head cut (head_cut.py), the int8 drafter converted once
into the cache (weights.load_converted) and a cut drafter under `spd`, on tiny models (fp32)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from fly_serve.build import build_engine
from fly_serve.loading.head_cut import CutHead, cut_head
from fly_serve.loading.loading import load_model, quantize_int8
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer
from fly_serve.loading.weights import converted_path

CUT = 100  # ids below it, plus the tiny tokenizer's added tokens
ADDED = (256, 257, 258)
KEPT = set(range(CUT)) | set(ADDED)
PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 12, 19)]


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_cut_head_keeps_rows_and_masks_the_rest():
    full = tiny_model(seed=0)
    cut = cut_head(copy.deepcopy(full), CUT, always=ADDED)
    assert isinstance(cut.lm_head, CutHead)
    want, got = logits(full, PROMPTS[1]), logits(cut, PROMPTS[1])
    keep = torch.tensor(sorted(KEPT))
    off = torch.ones(got.shape[-1], dtype=torch.bool)
    off[keep] = False
    assert got.shape == want.shape  # full width: q stays a distribution over the whole vocabulary
    torch.testing.assert_close(got[:, keep], want[:, keep], rtol=0, atol=1e-6)
    assert torch.isneginf(got[:, off]).all()
    # The tied embeddings were untied, not cut: every input id still has its row.
    assert cut.model.embed_tokens.weight.shape == full.model.embed_tokens.weight.shape
    assert not cut.config.tie_word_embeddings


@pytest.fixture
def local_tiny(tmp_path, monkeypatch):
    """A tiny model saved as a local directory (the converted cache keys on local weights), with
    the cache itself under tmp_path."""
    monkeypatch.setenv("FLY_SERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-local"
    tiny_model(seed=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("head_cut", [None, CUT])
def test_int8_converted_cache_round_trip(local_tiny, head_cut):
    variant = "int8" if head_cut is None else f"int8-head{head_cut}"
    cached = converted_path(local_tiny, variant)
    assert cached is not None and not cached.exists()
    messages = []
    first = load_model(local_tiny, "int8", head_cut=head_cut, progress=messages.append)
    assert cached.is_file() and any("converted once" in m for m in messages)
    messages.clear()
    again = load_model(local_tiny, "int8", head_cut=head_cut, progress=messages.append)
    assert not any("converted once" in m for m in messages)  # read back, not quantized again
    direct = AutoModelForCausalLM.from_pretrained(local_tiny, dtype=torch.float32).eval()
    if head_cut is not None:
        direct = cut_head(direct, head_cut, always=ADDED)
    direct = quantize_int8(direct)
    want = logits(direct, PROMPTS[2])
    assert torch.equal(logits(first, PROMPTS[2]), want)
    assert torch.equal(logits(again, PROMPTS[2]), want)


def record_drafts(engine) -> list[int]:
    """Every token the model drafter proposes from now on."""
    drafter, seen = engine.drafters["model"], []
    propose = drafter.propose

    def recording(rows):
        drafts = propose(rows)
        seen.extend(t for row in drafts.tokens for t in row)
        return drafts

    drafter.propose = recording
    return seen


@pytest.mark.parametrize("drafter", ["tiny:1", "tiny:0"])  # another model; the target itself, cut
@pytest.mark.parametrize("params", [dict(mode="spd"), dict(mode="spd", mla=False), dict(mode="fly", theta=1.0)])
def test_spd_with_cut_drafter_equals_ar(drafter, params):
    engine = build_engine("tiny:0", drafter, drafter_head_cut=CUT, max_model_len=256, progress=lambda _: None)
    engine.eos_ids = set()  # random models: run every request to max_tokens
    assert isinstance(engine.drafters["model"].runner.model.lm_head, CutHead)
    ar = [r.generated for r in engine.generate(PROMPTS, dict(mode="ar", max_tokens=30))]
    drafted = record_drafts(engine)
    reqs = engine.generate(PROMPTS, dict(params, k=4, max_tokens=30))
    assert [r.generated for r in reqs] == ar
    assert drafted
    if params.get("mla") is False:  # without prompt lookup every draft is the cut drafter's own
        assert set(drafted) <= KEPT
    if drafter == "tiny:0":  # the target cut: its drafts pass wherever the target's token is kept
        assert sum(r.stats.accepted for r in reqs) > 0


@pytest.mark.parametrize("bad", [0, -1, "x", True, 1.5])
def test_bad_head_cut_is_refused(bad):
    with pytest.raises(ValueError, match="drafter_head_cut"):
        build_engine("tiny:0", "tiny:1", drafter_head_cut=bad, progress=lambda _: None)
    with pytest.raises(ValueError, match="head_cut"):
        cut_head(tiny_model(seed=1), bad)
    if bad is not True:  # loading.py takes a bool as an int; build_engine refuses it first
        with pytest.raises(ValueError, match="head_cut"):
            load_model("tiny:1", "fp32", head_cut=bad)


def test_head_cut_of_a_loaded_drafter_is_refused():
    with pytest.raises(ValueError, match="drafter_head_cut"):
        build_engine(tiny_model(seed=0), tiny_model(seed=1), tokenizer=tiny_tokenizer(), drafter_head_cut=CUT)


def test_no_drafter_ignores_head_cut():
    engine = build_engine("tiny:0", None, drafter_head_cut=CUT, max_model_len=256, progress=lambda _: None)
    assert engine.drafters["model"] is None
