"""fp32 linear layers packed for oneDNN (fly_serve/runtime/onednn_linear.py): the same outputs as nn.Linear,
a model converted whole still decodes losslessly, and the choice honours its override. Which
kernel is faster is a benchmark's question (docs/journal.md), not asserted here."""

import pytest
import torch
from torch import nn

from fly_serve.build import build_engine
from fly_serve.loading.loading import load_model, load_tokenizer
from fly_serve.runtime import onednn_linear
from fly_serve.runtime.onednn_linear import ENV, PackedLinear, choose, pack

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="this torch has no oneDNN linear")


@pytest.fixture(autouse=True)
def own_choice(monkeypatch):
    """Each test with no override from the environment and its own record of kernels chosen, so
    that neither reaches the rest of the session."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(onednn_linear, "chosen", set())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 64), (2, 1, 64)])
def test_a_packed_layer_computes_what_the_layer_does(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias).eval()
    x = torch.randn(*shape)
    with torch.inference_mode():
        want, got = layer(x), PackedLinear(layer)(x)
        strided = torch.randn(*shape[:-1], 128)[..., ::2]  # a non-contiguous input
        want_strided, got_strided = layer(strided), PackedLinear(layer)(strided)
    assert got.shape == want.shape == (*shape[:-1], 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_strided, want_strided, rtol=1e-5, atol=1e-5)


def test_a_packed_model_gives_the_same_logits_and_decodes_losslessly(monkeypatch):
    dense = load_model("tiny:0", "fp32")
    monkeypatch.setenv(ENV, "onednn")  # tiny layers are below the size the choice times
    packed, drafter = load_model("tiny:0", "fp32"), load_model("tiny:1", "fp32")
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert sum(type(m) is PackedLinear for m in packed.modules()) == sum(type(m) is nn.Linear for m in dense.modules())
    ids = torch.randint(0, dense.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)
    engine = build_engine(packed, drafter, tokenizer=load_tokenizer("tiny:0"), calibrate=False)
    prompt = list(range(3, 20))
    [ar] = engine.generate([prompt], {"mode": "ar", "max_tokens": 24, "temperature": 0})
    [spd] = engine.generate([prompt], {"mode": "spd", "k": 4, "max_tokens": 24, "temperature": 0})
    assert spd.generated == ar.generated and spd.stats.drafted > 0


def test_the_choice_honours_its_override_and_keeps_small_or_non_fp32_models_dense(monkeypatch):
    big = nn.Sequential(nn.Linear(1024, 1024))  # at MIN_WEIGHTS: would be timed
    small = nn.Sequential(nn.Linear(64, 64))
    monkeypatch.setenv(ENV, "dense")
    assert choose(big) == "dense"
    monkeypatch.setenv(ENV, "oneDNN")
    assert choose(small) == "onednn"
    assert choose(nn.Sequential(nn.Linear(64, 64).to(torch.bfloat16))) == "dense"  # nothing fp32 to pack
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=ENV):
        choose(small)
    monkeypatch.delenv(ENV)
    said = []
    assert choose(small, said.append) == "dense" and said == []  # too small to time: dense, untimed
    assert choose(big, said.append) in onednn_linear.CHOICES
    assert len(said) == 1 and "1024 x 1024" in said[0] and "ms dense" in said[0]  # what was measured, said
    assert pack(big) == 1 and type(big[0]) is PackedLinear


def test_the_cost_profiles_key_names_the_kernels_chosen_at_load(monkeypatch):
    from fly_serve.k_auto.cost_calibration import machine

    assert machine()["linear"] == "none"
    monkeypatch.setenv(ENV, "dense")
    load_model("tiny:0", "fp32")
    assert machine()["linear"] == "dense"
    monkeypatch.setenv(ENV, "onednn")
    load_model("tiny:1", "fp32")
    assert machine()["linear"] == "dense+onednn"  # a profile timed on other kernels is not read back
    monkeypatch.setattr(onednn_linear, "chosen", set())
    onednn_linear.use_where_faster(nn.Sequential(nn.Linear(64, 64).to(torch.bfloat16)))
    assert machine()["linear"] == "none"  # bf16 layers are oneDNN's anyway: nothing chosen


def test_the_timed_layer_is_never_the_head_cut_or_whole(monkeypatch):
    from fly_serve.loading.head_cut import CutHead

    model = nn.Module()
    model.layer = nn.Linear(1024, 1024)
    model.lm_head = CutHead(nn.Linear(1024, 4096), torch.arange(2048))  # its .proj: 2048 x 1024, the largest
    said = []
    choose(model, said.append)
    assert len(said) == 1 and "1024 x 1024" in said[0] and "2048" not in said[0]


def test_a_forced_onednn_without_onednn_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(onednn_linear, "available", lambda: False)  # a torch build without it
    monkeypatch.setenv(ENV, "onednn")
    with pytest.raises(ValueError, match="no oneDNN"):
        choose(nn.Sequential(nn.Linear(64, 64)))
    monkeypatch.setenv(ENV, "dense")
    assert choose(nn.Sequential(nn.Linear(64, 64))) == "dense"
