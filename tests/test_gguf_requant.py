"""A drafter's GGUF requantized to Q4_0 (fly_serve/loading/gguf_requant.py): written once into the
cache and read back after, a file already as light run as shipped, the embedded drafter's "auto"
on llama.cpp, strict speculation with the requantized drafter still the target's own text, and
the precision refused where it cannot apply, naming the knob."""

import json

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.loading import gguf_requant
from fly_serve.loading.loading import gguf_path, load_model
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, gguf_file
from fly_serve.runtime.llama_runner import GGUFModel, LlamaRunner


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_SERVE_CACHE", str(tmp_path))
    return tmp_path


def test_a_heavy_file_is_requantized_once_and_a_light_one_runs_as_shipped(cache):
    src = gguf_path("tiny:1")  # the tiny model's file: f32
    assert gguf_requant.bits_per_weight(src) > 30
    notes = []
    out = gguf_requant.requantized(src, notes.append)
    assert out != src and out.parent == cache / "converted" and len(notes) == 1 and "Q4_0" in notes[0]
    assert gguf_requant.bits_per_weight(out) <= gguf_requant.LIGHT_BITS  # its f32 norms lift it past 4.5
    written = out.stat().st_mtime_ns
    assert gguf_requant.requantized(src, notes.append) == out and out.stat().st_mtime_ns == written
    assert len(notes) == 1  # read back, not written again
    assert not list(out.parent.glob(".*.tmp*"))  # renamed into place, nothing half-written left
    # the Q4_0 file is a model llama.cpp runs: the same vocabulary, finite logits
    r = LlamaRunner(GGUFModel(str(out)), n_slots=1, budget_tokens=256, threads=1)
    logits, _ = r.feed(["a"], [[5, 77, 100, 12]], tail=[1])
    assert logits.shape[-1] == GGUFModel(str(src)).n_vocab and torch.isfinite(logits).all()


def test_a_file_as_light_as_q4_0_is_its_own_requantization(cache):
    light = gguf_requant.requantized(gguf_path("tiny:1"))
    before = sorted(p.name for p in (cache / "converted").iterdir())
    assert gguf_requant.requantized(light) == light
    assert sorted(p.name for p in (cache / "converted").iterdir()) == before


def test_the_faithfulness_verdict_is_kept_for_its_reference_and_bound_only(cache):
    """Computed once and read back; a verdict of another reference text or confidence bound (an
    older fly-serve's) is computed again, never trusted."""
    src = gguf_path("tiny:1")
    light = gguf_requant.requantized(src)
    verdict = light.with_name(f"{light.stem}.agreement.json")
    first = gguf_requant.faithful(src, light)
    kept = json.loads(verdict.read_text())
    assert kept["confident"] == gguf_requant.CONFIDENT and len(kept["reference"]) == 12
    assert first == (kept["agreement"] >= gguf_requant.AGREEMENT)
    verdict.write_text(json.dumps({**kept, "agreement": 1.0}))  # read back as written
    assert gguf_requant.faithful(src, light) is True
    verdict.write_text(json.dumps({**kept, "agreement": 1.0, "reference": "another"}))
    assert gguf_requant.faithful(src, light) == first  # computed again
    assert json.loads(verdict.read_text()) == kept
    assert not list(light.parent.glob(".*.tmp*"))


@pytest.mark.real
def test_the_embedded_drafters_auto_on_llama_cpp_is_q4_0_and_shipped_keeps_the_file():
    shipped = gguf_file(DEFAULT_DRAFTER)
    assert gguf_requant.bits_per_weight(shipped) > 6  # Q5_0 body, Q8_0 head
    auto = load_model(DEFAULT_DRAFTER, "auto", runtime="auto", gguf_auto="q4_0", knob="drafter_precision")
    assert auto.path == str(gguf_requant.q4_0_path(shipped))
    assert gguf_requant.bits_per_weight(auto.path) < gguf_requant.Q4_0_BITS + 0.1  # f32 norms: a few
    kept = load_model(DEFAULT_DRAFTER, "shipped", runtime="auto", gguf_auto="q4_0", knob="drafter_precision")
    assert kept.path == str(shipped)
    verdict = gguf_requant.q4_0_path(shipped).with_name(f"{gguf_requant.q4_0_path(shipped).stem}.agreement.json")
    assert json.loads(verdict.read_text())["agreement"] >= gguf_requant.AGREEMENT  # checked once, kept
    # the target's auto is the file as shipped, always
    assert load_model(DEFAULT_TARGET, "auto", runtime="auto").path == str(gguf_file(DEFAULT_TARGET))


@pytest.mark.real
def test_a_drafter_its_q4_0_form_is_not_faithful_to_runs_as_shipped_unless_asked():
    """Gemma 3 270M's tied head and embeddings are most of its weights: at Q4_0 its confident
    greedy choices moved (0.71 agreement on the reference text, module docstring), so its auto is
    the file as shipped, said once; q4_0 asked for by name runs the requantized file."""
    shipped = gguf_file("gemma-3-270m")
    notes = []
    auto = load_model("gemma-3-270m", "auto", runtime="auto", gguf_auto="q4_0", progress=notes.append)
    assert auto.path == str(shipped)
    assert any("runs as shipped" in n and "q4_0 runs it anyway" in n for n in notes), notes
    asked = load_model("gemma-3-270m", "q4_0", runtime="auto", gguf_auto="q4_0", knob="drafter_precision")
    assert asked.path == str(gguf_requant.q4_0_path(shipped))


def test_strict_speculation_with_a_q4_0_drafter_gives_the_runtimes_own_text():
    """The drafter only proposes: at Q4_0 it proposes other tokens now and then, the text stays
    the target's. A tiny model's file runs as written under auto; q4_0 asked for requantizes it."""
    prompts = ["def fib(n):", "hello world, this is"]
    engine = build_engine(
        "tiny:0", "tiny:1", runtime="llama.cpp", drafter_precision="q4_0", max_batch=2, progress=lambda _: None
    )
    assert "q4_0" in engine.drafters["model"].runner.model.path
    params = {"max_tokens": 32, "temperature": 0, "k": 4}
    ar = engine.generate(prompts, {**params, "mode": "ar"})
    spd = engine.generate(prompts, {**params, "mode": "spd"})
    assert [r.generated for r in spd] == [r.generated for r in ar]
    assert sum(r.stats.drafted for r in spd) > 0
    as_written = build_engine("tiny:0", "tiny:1", runtime="llama.cpp", max_batch=1, progress=lambda _: None)
    assert as_written.drafters["model"].runner.model.path == str(gguf_path("tiny:1"))


def test_q4_0_is_refused_where_it_cannot_apply_naming_the_knob():
    with pytest.raises(
        ValueError, match=r"^drafter_precision: q4_0 is a GGUF drafter's precision on runtime llama.cpp"
    ):
        build_engine("tiny:0", "tiny:1", runtime="torch", drafter_precision="q4_0", max_batch=1)
    with pytest.raises(ValueError, match=r"^dtype: q4_0 applies to a draft model's GGUF file on llama.cpp"):
        load_model(DEFAULT_TARGET, "q4_0", runtime="auto", knob="dtype")
    with pytest.raises(ValueError, match=r"^drafter_precision: must be one of"):
        load_model(DEFAULT_DRAFTER, "q2_k", runtime="auto", knob="drafter_precision")


def test_on_a_gpu_a_gguf_precision_falls_back_to_torch_saying_so():
    """A profile's drafter precision must not stop a GPU host from starting (as int8 becomes bf16
    there): under runtime auto q4_0 or shipped on a GPU runs the drafter on torch, named in a note."""
    from fly_serve.loading.loading import resolve_runtime

    notes = []
    got = resolve_runtime(
        "auto", DEFAULT_DRAFTER, device="cuda", progress=notes.append, precision="q4_0", knob="drafter_precision"
    )
    assert got == "torch" and notes and notes[-1].startswith("drafter_precision: q4_0 is llama.cpp's")
    with pytest.raises(ValueError, match="a GPU needs runtime torch"):
        resolve_runtime("llama.cpp", DEFAULT_DRAFTER, device="cuda", precision="shipped", knob="drafter_precision")
