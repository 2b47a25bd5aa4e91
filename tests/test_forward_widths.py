"""A forward split into several llama_decode calls where measured cheaper (runtime/forward_widths.py):
the plan from timings, the runner's calls and logits under a plan, the cache."""

import json

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.loading.loading import load_model
from fly_serve.runtime import forward_widths
from fly_serve.runtime.llama_runner import LlamaRunner

TOL = 2e-3  # tests/test_llama_runtime.py: f16 K and V


@pytest.fixture(scope="module")
def gguf():
    return load_model("tiny:0", runtime="llama.cpp")


def runner(gguf, **kw) -> LlamaRunner:
    return LlamaRunner(gguf, **{"n_slots": 4, "budget_tokens": 1024, "threads": 1, **kw})


def test_the_plan_splits_only_where_the_split_is_cheaper_by_the_margin():
    # the 2-core EPYC's 1.5B target (ms): 8 tokens cost more than two calls of 4
    ms = [47, 80, 110, 123, 155, 190, 212, 293, 316, 322, 348, 355, 375, 402, 418, 380]
    plan = forward_widths.plan([x / 1000 for x in ms])
    assert plan[8 - 1] == (4, 4)
    assert plan[9 - 1] == (5, 4)
    assert all(plan[n - 1] == (n,) for n in (1, 2, 4, 7, 10, 16))
    assert all(sum(p) == n for n, p in enumerate(plan, 1))
    # even widths (a machine without the step) and a saving under the margin: one call each
    assert forward_widths.plan([0.05 * n for n in range(1, 17)]) == [(n,) for n in range(1, 17)]
    assert forward_widths.plan([1.0, 2.0, 3.0, 3.9])[3] == (4,)  # 2 + 2 would save 2.5% only
    assert forward_widths.plan([1.0, 1.5, 3.0, 4.5])[3] == (2, 2)


def test_a_split_forward_gives_the_logits_of_one_call_and_makes_the_calls_planned(gguf):
    one, split = runner(gguf), runner(gguf)
    split.set_widths([(1,), (1, 1), (2, 1), (2, 2), (3, 2)])
    calls = []
    real = split._decode_chunk
    split._decode_chunk = lambda ids, *a: (calls.append(len(ids)), real(ids, *a))[1]
    rows = [[5, 77, 100, 12, 40, 41], [7, 8, 9, 10]]
    for r in (one, split):
        r.feed(["a", "b"], rows, tail=[1, 1])  # both rows held: what follows feeds only the new tokens
    calls.clear()
    grown = [rows[0] + [200, 3], rows[1] + [250, 17, 9]]  # 5 tokens in all: (3, 2)
    want, fed = one.feed(["a", "b"], grown, tail=[2, 3])
    got, fed_split = split.feed(["a", "b"], grown, tail=[2, 3])
    assert calls == [3, 2] and fed == fed_split == [2, 3]
    assert got.shape == want.shape and torch.allclose(got, want, atol=TOL)
    calls.clear()
    split.feed(["a", "b"], [grown[0] + [1], grown[1] + [2]], tail=[1, 1])  # a plain step of 2 rows
    assert calls == [1, 1]
    calls.clear()
    split.feed(["a"], [grown[0] + [1] + list(range(20, 30))], tail=[1])  # past the plan: one call
    assert calls == [10]


def test_the_plan_is_measured_once_and_read_from_the_cache_after(gguf, tmp_path):
    r = runner(gguf)
    key = {"model": "tiny:0", "threads": 1}
    said = []
    plan = forward_widths.cached_plan(r, key, tmp_path, progress=said.append)
    assert len(plan) == forward_widths.MAX_WIDTH and all(sum(p) == n for n, p in enumerate(plan, 1))
    (entry,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert entry["key"] == key and len(entry["seconds"]) == forward_widths.MAX_WIDTH
    assert all(s > 0 for s in entry["seconds"]) and said
    assert forward_widths.KEY not in r.cache.rows  # the timing row is released
    said.clear()
    assert forward_widths.cached_plan(r, key, tmp_path, progress=said.append) == plan and not said
    # another key measures again
    forward_widths.cached_plan(r, key | {"threads": 2}, tmp_path, progress=said.append)
    assert said and len(list(tmp_path.glob("*.json"))) == 2


def test_the_engine_sets_a_plan_on_its_llama_cpp_runners_unless_turned_off():
    on = build_engine("tiny:0", "tiny:1", runtime="llama.cpp", max_batch=2, progress=lambda _: None)
    off = build_engine(
        "tiny:0", "tiny:1", runtime="llama.cpp", max_batch=2, forward_split=False, progress=lambda _: None
    )
    assert len(on.scorer.runner.widths) == forward_widths.MAX_WIDTH
    assert len(on.drafters["model"].runner.widths) == forward_widths.MAX_WIDTH
    assert off.scorer.runner.widths is None and off.drafters["model"].runner.widths is None
    ids = on.tokenizer.encode("def fib(n):")
    params = {"mode": "spd", "k": 4, "max_tokens": 24, "temperature": 0}
    assert on.generate([ids], params)[0].generated == off.generate([ids], params)[0].generated


def test_a_split_forward_that_fails_in_a_later_call_leaves_no_cells_behind(gguf):
    """The first call of a split forward writes its cells; when a later call fails, the row goes
    back to what it held before the forward, cells included, and the next forward computes the
    same logits as a runner that never failed."""
    clean, failing = runner(gguf), runner(gguf)
    plan = [(n,) for n in range(1, 17)]
    plan[6 - 1] = (3, 3)
    failing.set_widths(plan)
    base = [5, 77, 100, 12, 40, 41, 42, 200]
    for r in (clean, failing):
        r.feed(["a"], [base], tail=[1])
    real, calls = failing._decode_chunk, []

    def second_call_fails(ids, *a):
        calls.append(len(ids))
        if len(calls) == 2:
            raise RuntimeError("llama_decode failed (-1): the second call")
        return real(ids, *a)

    failing._decode_chunk = second_call_fails
    grown = base + [3, 9, 250, 17, 1, 2]
    with pytest.raises(RuntimeError, match="second call"):
        failing.feed(["a"], [grown], tail=[6])
    assert calls == [3, 3] and failing.cache.rows["a"].tokens == base
    failing._decode_chunk = real
    want, _ = clean.feed(["a"], [grown], tail=[6])
    got, fed = failing.feed(["a"], [grown], tail=[6])
    assert fed == [6] and torch.allclose(got, want, atol=TOL)


def test_a_cached_plan_that_does_not_add_up_is_measured_again(gguf, tmp_path):
    r = runner(gguf)
    key = {"model": "tiny:0", "threads": 1}
    plan = forward_widths.cached_plan(r, key, tmp_path, progress=lambda _: None)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["plan"][7] = [4, 3]  # 8 tokens in calls of 7: a token would be skipped
    path.write_text(json.dumps(entry))
    said = []
    again = forward_widths.cached_plan(r, key, tmp_path, progress=said.append)
    assert said and forward_widths.valid(again) and len(again) == len(plan)
