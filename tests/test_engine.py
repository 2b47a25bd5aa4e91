"""The engine on tiny random models (fp32): exactness, batching, join/leave, stops, bad input."""

import os

import pytest
import torch

from fly_serve import prompt_lookup
from fly_serve.build import build_engine
from fly_serve.params import ParamError
from fly_serve.runner import Runner
from fly_serve.tiny import tiny_model, tiny_tokenizer

DEVICE = os.environ.get("FLY_TEST_DEVICE", "cpu")  # scripts/gpu_check.sh runs these on "cuda"
TARGET, DRAFTER = tiny_model(seed=0).to(DEVICE), tiny_model(seed=1, num_hidden_layers=1).to(DEVICE)
PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13, 21)]


def engine(drafter=DRAFTER, **kw):
    eng = build_engine(TARGET, drafter, tokenizer=tiny_tokenizer(), max_model_len=256, **kw)
    eng.eos_ids = set()  # random models: run every request to max_tokens
    return eng


def generate(prompts=PROMPTS, drafter=DRAFTER, **params):
    return [r.generated for r in engine(drafter).generate(prompts, dict(max_tokens=30, **params))]


AR = generate(mode="ar")


def test_runner_matches_transformers_and_rolls_back():
    runner = Runner(TARGET, n_slots=2, capacity=4)
    seq = PROMPTS[3]
    full = TARGET(torch.tensor([seq], device=DEVICE)).logits[0]
    runner.feed(["a"], [seq[:10] + [1, 2, 3]])  # three tokens that will be rolled back
    logits, fed = runner.feed(["a"], [seq])
    assert fed == [len(seq) - 10]
    assert torch.allclose(logits[0], full[10:], atol=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        dict(mode="spd"),
        dict(mode="fly", theta=1.0),
        dict(mode="pld"),
        dict(mode="spd", mla=False),
        dict(mode="spd", k=3),
    ],
)
def test_lossless_modes_equal_ar(params):
    assert generate(**params) == AR


def test_drafter_equal_to_target_accepts_everything():
    reqs = engine(drafter=TARGET).generate(PROMPTS, dict(mode="spd", k=4, max_tokens=25))
    for r in reqs:
        assert r.generated == AR[PROMPTS.index(r.tokens[: r.n_prompt])][:25]
        assert r.stats.rounds == 5 and r.stats.recovered == 0  # 5 + 5 + 5 + 5 + 5 tokens
        assert r.stats.accepted == r.stats.drafted == 20 and r.stats.bonus == 5


def test_batched_equals_alone():
    for prompt, batched in zip(PROMPTS, generate(mode="fly", theta=0.0, window=1)):
        assert generate([prompt], mode="fly", theta=0.0, window=1) == [batched]


def test_join_and_leave_between_rounds():
    eng = engine()
    first = eng.add(PROMPTS[0], dict(mode="spd", max_tokens=30))
    short = eng.add(PROMPTS[1], dict(mode="ar", max_tokens=3))
    for _ in range(3):
        eng.step()
    assert short.finished and short.generated == AR[1][:3]
    late = eng.add(PROMPTS[2], dict(mode="pld", max_tokens=30))
    while eng.has_work():
        eng.step()
    assert first.generated == AR[0] and late.generated == AR[2]


def test_stop_string_eos_and_length():
    eng = engine()
    ref = eng.generate([PROMPTS[0]], dict(mode="ar", max_tokens=30))[0]
    stop = ref.text[10:12]
    req = eng.generate([PROMPTS[0]], dict(mode="spd", max_tokens=30, stop=[stop]))[0]
    assert req.finish_reason == "stop" and req.text == ref.text[: ref.text.index(stop)]
    assert ref.finish_reason == "length" and len(ref.generated) == 30
    eos = ref.generated[5]
    eng.eos_ids = {eos}
    req = eng.generate([PROMPTS[0]], dict(mode="fly", max_tokens=30))[0]
    assert req.finish_reason == "stop" and req.generated == ref.generated[: ref.generated.index(eos)]


def test_streamed_deltas_add_up_to_the_text():
    eng = engine()
    req = eng.add(PROMPTS[1], dict(mode="spd", max_tokens=30))
    pieces = []
    while not req.finished:
        eng.step()
        pieces.append(req.delta())
    assert "".join(pieces) == req.text and len([p for p in pieces if p]) > 1


def test_seeded_sampling_is_reproducible_and_batch_independent():
    params = dict(mode="fly", temperature=0.9, top_p=0.95, seed=7)
    a = generate(**params)
    assert a == generate(**params)
    assert generate([PROMPTS[2]], **params) == [a[2]]
    assert a != generate(**{**params, "seed": 8})


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", 10_000),
        ("k", 0),
        ("window", 10),
        ("theta", 1.5),
        ("theta", -0.1),
        ("mode", "nope"),
        ("entropy", "x"),
        ("top_p", 0.0),
        ("temperature", -1),
        ("seed", 10**20),
        ("seed", 1.5),
    ],
)
def test_bad_input_names_the_field(field, value):
    eng = engine()
    good = eng.add(PROMPTS[0], dict(mode="spd", max_tokens=5))
    with pytest.raises(ParamError, match=f"^{field}:") as e:
        eng.add(PROMPTS[1], {"k": 10, "max_tokens": 5, field: value})
    assert e.value.field == field
    while eng.has_work():
        eng.step()
    assert good.generated == AR[0][:5]  # the bad request never reached the batch


def test_empty_prompt_and_missing_drafter():
    with pytest.raises(ParamError, match="^prompt:"):
        engine().add("", dict(mode="ar"))
    with pytest.raises(ParamError, match="^mode:"):
        engine(drafter=None).add(PROMPTS[0], dict(mode="fly", max_tokens=5))
    assert engine(drafter=None).generate([PROMPTS[0]], dict(mode="pld", max_tokens=30))[0].generated == AR[0]


def test_pld_proposals():
    assert prompt_lookup.propose([1, 2, 3, 9, 1, 2, 3], k=3) == [9, 1, 2]  # the 3-gram 1 2 3 matched
    assert prompt_lookup.propose([5, 6, 7, 5, 6], k=4) == [7, 5, 6]  # fewer near the end
    assert prompt_lookup.propose([1, 2, 3, 4], k=3) == []  # no match; the suffix never matches itself
    assert prompt_lookup.propose([4, 1, 8, 4, 2, 8, 4], k=2) == [2, 8]  # the latest occurrence wins
    assert prompt_lookup.propose([1, 2, 1, 3, 1, 2], k=2, max_n=2, min_n=2) == [1, 3]
    assert prompt_lookup.propose([7, 7], k=5) == [7]


def test_unsure_drafter_stops_early_and_stays_exact():
    eng = engine(draft_min_confidence=1.0)
    reqs = eng.generate(PROMPTS, dict(mode="spd", k=5, mla=False, max_tokens=30))
    assert [r.generated for r in reqs] == AR
    assert all(0 < r.stats.drafted <= r.stats.rounds for r in reqs)  # at most one draft a round, not k


@pytest.mark.parametrize("prompt", [[5, 300], [-1, 4], [1, True], "a \ud800 b"])
def test_prompts_that_would_break_a_round_are_refused(prompt):
    eng = engine()
    good = eng.add(PROMPTS[0], dict(mode="fly", max_tokens=5))
    with pytest.raises(ParamError, match="^prompt:"):
        eng.add(prompt, dict(mode="fly", max_tokens=5))
    while eng.has_work():
        eng.step()
    assert good.generated == AR[0][:5]


def test_huge_seed_samples_and_window_defaults_below_k():
    eng = engine()
    req = eng.generate([PROMPTS[1]], dict(mode="fly", k=3, temperature=0.8, seed=2**62, max_tokens=8))[0]
    assert len(req.generated) == 8 and req.params.effective_window == 2


def test_fail_running_ends_the_batch_with_the_error():
    eng = engine()
    reqs = [eng.add(p, dict(mode="fly", max_tokens=20)) for p in PROMPTS[:2]]
    eng.step()
    failed = eng.fail_running("target died")
    assert failed == reqs and not eng.running
    assert all(r.finish_reason == "error" and r.error == "target died" for r in reqs)
    assert eng.generate([PROMPTS[0]], dict(mode="ar", max_tokens=30))[0].generated == AR[0]


def test_round_result_adds_up():
    eng = engine()
    reqs = [eng.add(p, dict(mode=m, max_tokens=30)) for p, m in zip(PROMPTS, ["fly", "ar", "spd", "pld"])]
    result = eng.step()
    assert result.advanced == reqs and result.batch_size == 4
    assert result.emitted == sum(r.stats.emitted for r in reqs)
    assert result.drafted == sum(r.stats.drafted for r in reqs)
    assert result.accepted + result.loosely_accepted == sum(r.stats.accepted + r.stats.loosely_accepted for r in reqs)
    assert result.drafting_rows == sum(1 for r in reqs if r.stats.drafted)


def test_different_logit_widths_sample_and_stay_exact():
    """A drafter with fewer logits than the target (as Qwen2.5 0.5B for 7B): both are cut to the
    tokenizer's tokens; greedy spd still equals ar and sampling runs."""
    narrow = tiny_model(seed=1, num_hidden_layers=1, vocab_size=259).to(DEVICE)
    wide = tiny_model(seed=0, vocab_size=272).to(DEVICE)
    eng = build_engine(wide, narrow, tokenizer=tiny_tokenizer(), max_model_len=256)
    eng.eos_ids = set()
    ar = eng.generate(PROMPTS, dict(mode="ar", max_tokens=12))
    spd = eng.generate(PROMPTS, dict(mode="spd", max_tokens=12))
    assert [r.generated for r in spd] == [r.generated for r in ar]
    sampled = eng.generate(PROMPTS, dict(mode="fly", temperature=1.0, top_p=0.9, seed=3, max_tokens=12))
    assert all(len(r.generated) == 12 for r in sampled)
    with pytest.raises(ValueError, match="^drafter:"):
        build_engine(wide, tiny_model(seed=1, vocab_size=200), tokenizer=tiny_tokenizer())


class FlakyScorer:
    """The real scorer with injected faults: rows holding `poison` always break the forward;
    the first `transient` calls fail whatever they hold."""

    def __init__(self, scorer, poison=None, transient=0):
        self.scorer, self.poison, self.transient, self.calls = scorer, poison, transient, 0
        self.vocab_size = scorer.vocab_size

    def verify(self, rows, drafts):
        self.calls += 1
        if self.calls <= self.transient or any(self.poison in r.tokens for r in rows):
            raise RuntimeError("injected fault")
        return self.scorer.verify(rows, drafts)

    def release(self, keys):
        self.scorer.release(keys)


class DeadDrafter:
    def __init__(self):
        self.calls = 0

    def propose(self, rows):
        self.calls += 1
        raise ConnectionError("drafter replica died")

    def release(self, keys):
        raise ConnectionError("drafter replica died")


def test_a_row_that_breaks_the_round_fails_alone():
    eng = engine()
    poison = 257  # a special token, in no other prompt or output
    assert not any(poison in t for t in PROMPTS + AR)
    eng.scorer = FlakyScorer(eng.scorer, poison=poison)
    poisoned = PROMPTS[2] + [poison]
    reqs = eng.generate(PROMPTS[:2] + [poisoned] + PROMPTS[3:], dict(mode="fly", max_tokens=30))
    assert reqs[2].finish_reason == "error" and "injected fault" in reqs[2].error
    assert [r.generated for i, r in enumerate(reqs) if i != 2] == [AR[0], AR[1], AR[3]]


def test_a_transient_failure_is_retried_and_a_dead_target_fails_the_batch_quickly():
    eng = engine()
    eng.scorer = FlakyScorer(eng.scorer, transient=1)
    assert [r.generated for r in eng.generate(PROMPTS, dict(mode="fly", max_tokens=30))] == AR
    eng.scorer.transient = 10**9  # every call fails from now on
    reqs = [eng.add(p, dict(mode="spd", max_tokens=30)) for p in PROMPTS]
    calls = eng.scorer.calls
    result = eng.step()
    assert result.failed == reqs and all(r.finish_reason == "error" for r in reqs)
    assert eng.scorer.calls - calls <= 4  # first try, retry, two halves
    assert not eng.has_work()


def test_a_dead_drafter_never_fails_a_request():
    eng = engine()
    dead = eng.drafters["model"] = DeadDrafter()
    reqs = eng.generate(PROMPTS, dict(mode="spd", max_tokens=30))
    assert [r.generated for r in reqs] == AR and dead.calls > 1  # retried every round
    sampled = eng.generate(PROMPTS[:2], dict(mode="fly", temperature=0.9, seed=1, max_tokens=10))
    assert all(len(r.generated) == 10 for r in sampled)


def test_auto_k_stays_exact_and_backs_off_when_verification_is_costly():
    """k "auto" only changes how many drafts a row gets: spd stays ar. Where verifying a token
    costs as much as a whole round, speculation does not pay and the policy drafts nothing."""
    eng = engine()
    reqs = eng.generate(PROMPTS, dict(mode="spd", k="auto", k_max=6, max_tokens=30))
    assert [r.generated for r in reqs] == AR
    steep = {
        "verify": {"tokens": [1, 2], "seconds": [1.0, 2.0]},
        "draft": {"per_round": 0.0, "per_forward": 1.0, "per_row_forward": 1.0},
    }
    eng = engine(speculation_profile=steep)
    eng.policy.tracker.prior = 0.05  # a drafter that is rarely right
    reqs = [eng.add(p, dict(mode="fly", k="auto", max_tokens=30)) for p in PROMPTS]
    eng.step()
    assert all(r.stats.drafted == 0 for r in reqs)
    with pytest.raises(ParamError, match="^k:"):
        eng.add(PROMPTS[0], dict(k="many", max_tokens=5))


def test_admission_at_the_kv_budget_edge():
    """A request that can never fit the KV cache is refused at once; one that cannot fit now waits
    for a running request to finish; none fails the batch."""
    eng = engine(kv_budget_tokens=64, max_batch=4)  # 4 blocks of 16 tokens
    assert eng.kv_capacity() == 64
    with pytest.raises(ParamError, match="^max_tokens:.*KV cache of 64"):
        eng.add(PROMPTS[3], dict(mode="spd", k=4, max_tokens=60))
    first = eng.add(PROMPTS[1], dict(mode="spd", k=4, max_tokens=30))  # needs 8 + 30 + 5 = 43
    second = eng.add(PROMPTS[0], dict(mode="spd", k=4, max_tokens=20))  # needs 3 + 20 + 5 = 28
    eng.step()
    assert eng.running == [first] and list(eng.waiting) == [second]
    while eng.has_work():
        eng.step()
    assert first.generated == AR[1] and second.generated == AR[0][:20]
