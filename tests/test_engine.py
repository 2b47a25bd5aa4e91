"""The engine on tiny random models (fp32): exactness, batching, join/leave, stops, bad input."""

import os

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.contracts import Row
from fly_serve.drafting import prompt_lookup
from fly_serve.drafting.drafters import ModelDrafter, lookups_pay, stopping
from fly_serve.engine.engine import Engine
from fly_serve.engine.params import ParamError, Params
from fly_serve.k_auto.round_cost import CostProfile
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer
from fly_serve.runtime.runner import Runner

DEVICE = os.environ.get("FLY_TEST_DEVICE", "cpu")  # "cuda" on a GPU host (the device check: scripts/gpu_check.py)
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


def test_folded_attention_equals_grouped_heads():
    """On a CPU a short forward folds its query heads onto their KV head (runner.fold_queries):
    the same logits as SDPA's grouped heads, for rows of different lengths, equal lengths, one
    token a row and several (the tiny target has 4 query heads on 2 KV heads)."""
    folded, grouped = Runner(TARGET, n_slots=4), Runner(TARGET, n_slots=4)
    grouped.fold = False
    assert folded.fold == (DEVICE == "cpu")
    keys = ["a", "b", "c"]
    same = PROMPTS[3][:12]
    steps = [  # (rows' tokens, tail)
        ([PROMPTS[1], PROMPTS[2], PROMPTS[3]], None),  # prefill of 3 lengths
        ([PROMPTS[1] + [5], PROMPTS[2] + [6], PROMPTS[3] + [7]], [1, 1, 1]),  # decode, rows of 3 lengths
        ([PROMPTS[1] + [5, 8, 9, 10], PROMPTS[2] + [6, 1], PROMPTS[3] + [7, 2, 3]], [4, 2, 3]),  # verification
        ([same, same + [4]], [1, 1]),  # prefill from position 0 (causal), padded
        ([same + [4], same + [4]], [1, 1]),  # rows of equal length: their prefixes, then...
        ([same + [4, 9], same + [4, 2]], [1, 1]),  # ... a decode step that sees every key (no mask)
    ]
    for tokens, tail in steps:
        got, _ = folded.feed(keys[: len(tokens)], tokens, tail=tail)
        want, _ = grouped.feed(keys[: len(tokens)], tokens, tail=tail)
        assert torch.allclose(got, want, atol=1e-5)


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
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("temperature", -1),
        ("temperature", 2.5),  # OpenAI's range: [0, 2]
        ("stop", ["a", "b", "c", "d", "e"]),  # OpenAI's bound: 4
        ("seed", 10**20),
        ("seed", 1.5),
        ("mla_sources", "pld,nope"),
        ("mla_sources", "pld,pld"),
        ("mla_sources", ""),
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


def test_rows_of_a_batch_stop_drafting_together():
    # the rule: rows with a floor stop together, when their confidences sum below their floors
    assert stopping([0.9, 0.2], [0.5, 0.5]) == set()  # the batch's chances pay for its next forward
    assert stopping([0.6, 0.2], [0.5, 0.5]) == {0, 1}  # they do not: the sure row stops too
    assert stopping([0.3], [0.5]) == {0} and stopping([0.6], [0.5]) == set()  # alone: its own floor
    assert stopping([0.1, 0.9], [0.0, 0.5]) == set()  # no floor (a fixed k): never judged
    assert stopping([0.9, 0.1], [0.0, 0.5]) == {1}
    # through the drafter: a row whose floor no token reaches stops after one draft, the batch with it
    drafter = ModelDrafter(Runner(DRAFTER, n_slots=4))

    def drafted(*floors):
        rows = [Row(f"r{i}", PROMPTS[i], k=4, mla=False, min_confidence=f) for i, f in enumerate(floors)]
        out = [len(d) for d in drafter.propose(rows).tokens]
        drafter.release([r.key for r in rows])
        return out

    assert drafted(1.0, 1.0) == [1, 1]
    assert drafted(1.0, 0.0) == [1, 4]  # the row without a floor drafts its k
    assert drafted(1e-9, 1e-9) == [4, 4]  # any token's confidence beats 1e-9


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


def test_a_profile_window_that_does_not_fit_the_requests_k_is_derived():
    profile = Params(mode="fly", k=15, window=6)
    assert profile.merged({"k": 3}).effective_window == 2  # not a 400 about a window not sent
    assert profile.merged({"k": 10}).effective_window == 6  # it fits: the profile's stays
    assert profile.merged({"k": "auto", "k_max": 4}).effective_window == 3
    with pytest.raises(ParamError, match="window"):  # a window the request sent is its own
        engine().add(PROMPTS[0], profile.merged({"k": 3, "window": 6}))


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


# verification nearly free, drafter forwards cheap: k "auto" drafts whenever it can
DRAFTING_PAYS = {
    "verify": {"tokens": [1, 16], "seconds": [1.0, 1.01]},
    "draft": {"per_round": 0.0, "per_forward": 0.01, "per_row_forward": 0.01},
}


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


def test_a_k_auto_rows_first_round_never_waits_for_the_drafters_prefill():
    """The round that prefills a prompt makes no model draft under k "auto" (the drafter would
    prefill the whole prompt first, and the first token would wait for it); the row drafts from
    the next round on, and the text stays ar's."""
    eng = engine(speculation_profile=DRAFTING_PAYS)
    drafter = eng.drafters["model"]
    req = eng.add(PROMPTS[3], dict(mode="spd", k="auto", k_max=6, mla=False, max_tokens=30))
    before = drafter.forwards
    first = eng.step()
    assert first.drafted == 0 and drafter.forwards == before
    assert drafter.runner.cache.valid(req.id, req.tokens) == 0  # nor did it prefill the prompt
    while not req.finished:
        eng.step()
    assert req.stats.drafted > 0 and req.generated == AR[3]
    lookup = eng.add(PROMPTS[3] * 2, dict(mode="pld", k="auto", k_max=6, max_tokens=5))
    assert eng.step().drafted > 0 and lookup.stats.drafted > 0  # a model-free mode drafts from its first round


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


# ---- model-free draft sources as modes and as MLA levels (suffix index, token recycling)
# The tiny pair above decodes one token over and over, which any source drafts; these tests use a
# target whose outputs vary (larger initial weights) and a drafter that is a noisy copy of it, so
# drafts are partly accepted and every source's alignment with the text is exercised.


def _noisy_copy(model, scale: float, seed: int = 3):
    copy = tiny_model(seed=seed, initializer_range=0.2).to(DEVICE)
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    for p in copy.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(DEVICE) * scale)
    return copy


VARIED = tiny_model(seed=0, initializer_range=0.2).to(DEVICE)
NOISY = _noisy_copy(VARIED, 0.01)
ALL_SOURCES = "pld,suffix,recycle"


def varied_engine(drafter=NOISY, **kw):
    eng = build_engine(VARIED, drafter, tokenizer=tiny_tokenizer(), max_model_len=256, **kw)
    eng.eos_ids = set()
    return eng


VARIED_AR = [r.generated for r in varied_engine().generate(PROMPTS, dict(mode="ar", max_tokens=30))]


def test_varied_pair_varies_and_partly_agrees():
    """The premise of the tests below: outputs are not one repeated token, and the drafter's
    drafts are partly rejected."""
    assert all(len(set(g)) > 10 for g in VARIED_AR)
    reqs = varied_engine().generate(PROMPTS, dict(mode="spd", k=4, mla=False, max_tokens=30))
    assert [r.generated for r in reqs] == VARIED_AR
    assert 0 < sum(r.stats.accepted for r in reqs) < sum(r.stats.drafted for r in reqs)


def test_free_sources_and_mla_levels_equal_ar_after_learning():
    """suffix and recycle learn from this engine's traffic: on a fresh engine they have little or
    nothing to draft from; once requests have finished (the suffix index) and rounds were verified
    (the recycler), they draft, and every mode still equals ar."""
    eng = varied_engine()
    first = eng.generate(PROMPTS, dict(mode="suffix", max_tokens=30))
    assert [r.generated for r in first] == VARIED_AR
    assert all(r.stats.drafted == 0 for r in first)  # nothing had finished before them
    assert eng.suffix_index.num_sequences == len(PROMPTS) and eng.recycler.nbytes > 0
    for params in [
        dict(mode="suffix"),
        dict(mode="recycle"),
        dict(mode="spd", mla_sources=ALL_SOURCES),
        dict(mode="spd", mla_sources="recycle"),
        dict(mode="spd", k=5, mla_sources="suffix,pld"),
        dict(mode="fly", theta=1.0, mla_sources=ALL_SOURCES),
        dict(mode="suffix", k="auto", k_max=6),
        dict(mode="recycle", k="auto", k_max=6),
        dict(mode="spd", k="auto", k_max=6, mla_sources=ALL_SOURCES),
    ]:
        reqs = eng.generate(PROMPTS, dict(max_tokens=30, **params))
        assert [r.generated for r in reqs] == VARIED_AR, params
        # (k "auto" may back off the model drafter on tiny models: its forward costs about the target's)
        assert sum(r.stats.drafted for r in reqs) > 0 or params["mode"] == "spd" and params.get("k") == "auto", params
    # The same prompts again: the index holds each whole earlier answer, so suffix drafts all of it.
    again = eng.generate(PROMPTS, dict(mode="suffix", k=8, max_tokens=30))
    assert [r.generated for r in again] == VARIED_AR
    assert all(r.stats.accepted == r.stats.drafted >= 25 for r in again)


def test_recycle_drafts_are_partly_rejected_and_stay_exact():
    """Recycled chains follow only the last token, so on varied text most are rejected: the
    strict decision then emits the target's own token (and the output stays ar)."""
    eng = varied_engine()
    eng.generate(PROMPTS, dict(mode="ar", max_tokens=30))
    reqs = eng.generate(PROMPTS, dict(mode="recycle", k=4, max_tokens=30))
    assert [r.generated for r in reqs] == VARIED_AR
    assert all(r.stats.drafted > r.stats.accepted for r in reqs)


def test_mla_sources_advance_the_drafter_several_tokens_per_forward():
    """MLA with the suffix index: a repeated request is proposed whole, the drafter (here the
    target itself) confirms it in one forward instead of one forward a token, and the output
    stays ar."""
    eng = varied_engine(drafter=VARIED)
    eng.generate(PROMPTS[:1], dict(mode="ar", max_tokens=30))
    drafter = eng.drafters["model"]
    before = drafter.forwards
    alone = eng.generate(PROMPTS[:1], dict(mode="spd", k=8, mla=False, max_tokens=30))[0]
    without = drafter.forwards - before
    before = drafter.forwards
    mla = eng.generate(PROMPTS[:1], dict(mode="spd", k=8, mla_sources="suffix", max_tokens=30))[0]
    assert alone.generated == mla.generated == VARIED_AR[0]
    assert mla.stats.drafted == alone.stats.drafted and drafter.forwards - before < without / 2


@pytest.mark.parametrize("row_price, carried", [(0.1, False), (0.0, True)])
def test_a_batch_carries_lookup_proposals_only_where_they_pay(row_price, carried):
    """A repeated request, proposed whole by the suffix index, shares the drafter's forwards with a
    request that has no proposal. Where a row costs a share of a forward (a CPU's profile), its
    proposals would widen every forward and never save one: the forward drafts it a token (as
    without MLA). Where width is free (a GPU's), they ride and the repeated row drafts in a few
    forwards. The text is ar either way."""
    eng = varied_engine(drafter=VARIED)
    eng.policy.set_profile(CostProfile([1, 2], [1.0, 1.1], draft_per_forward=1.0, draft_per_row_forward=row_price))
    eng.generate(PROMPTS[:1], dict(mode="ar", max_tokens=30))
    drafter, shared = eng.drafters["model"], []  # the repeated row's (drafts, forwards) in shared calls
    propose = drafter.propose

    def recorded(rows):
        got = propose(rows)
        if len(rows) == 2:
            shared.append((len(got.tokens[0]), got.row_forwards[0]))
        return got

    drafter.propose = recorded
    knobs = dict(mode="spd", k=8, max_tokens=30)
    reqs = eng.generate(PROMPTS[:2], [{**knobs, "mla_sources": "suffix"}, {**knobs, "mla": False}])
    assert [r.generated for r in reqs] == VARIED_AR[:2]
    drafted, forwards = map(sum, zip(*shared))
    assert drafted >= 16 and (forwards < drafted / 2) == carried


def test_lookups_pay_alone_and_in_batches_by_the_price_of_a_row():
    assert lookups_pay([0.5], 0.06) and not lookups_pay([0.02], 0.06)  # alone: unless they never hold
    assert lookups_pay([0.5, 0.5], 0.06)  # two rows: the forward they may save is worth it
    assert not lookups_pay([0.5] * 8, 0.06)  # eight: all eight must hold to save one
    assert not lookups_pay([0.9, None], 0.06)  # a row without a proposal: no forward can be saved
    assert lookups_pay([0.5] * 8, 0.0) and lookups_pay([0.9, None], 0.0)  # width for free (a GPU)


def test_a_batch_mixing_every_mode_equals_ar():
    eng = varied_engine()
    eng.generate(PROMPTS, dict(mode="ar", max_tokens=30))  # gives suffix and recycle something to draft
    modes = [
        dict(mode="ar"),
        dict(mode="pld"),
        dict(mode="suffix"),
        dict(mode="recycle"),
        dict(mode="spd"),
        dict(mode="spd", mla_sources=ALL_SOURCES),
        dict(mode="fly", theta=1.0, mla_sources="recycle,suffix"),
        dict(mode="recycle", k="auto"),
    ]
    which = [i % len(PROMPTS) for i in range(len(modes))]
    reqs = eng.generate([PROMPTS[i] for i in which], [dict(max_tokens=30, **m) for m in modes])
    assert [r.generated for r in reqs] == [VARIED_AR[i] for i in which]
    assert all(r.stats.drafted > 0 for r, m in zip(reqs, modes) if m["mode"] != "ar")


def test_free_sources_sample_reproducibly():
    """T > 0: the sources' proposals are deterministic (a one-hot q), so the target's sampling is
    exact; a seeded run repeats on an engine that learned the same things."""

    def run(params):
        eng = varied_engine()
        eng.generate(PROMPTS, dict(mode="ar", max_tokens=30))
        reqs = eng.generate(PROMPTS, dict(max_tokens=20, temperature=0.9, seed=5, **params))
        return [r.generated for r in reqs], sum(r.stats.drafted for r in reqs)

    for params in [dict(mode="suffix"), dict(mode="recycle"), dict(mode="fly", mla_sources=ALL_SOURCES)]:
        out, drafted = run(params)
        assert all(len(g) == 20 for g in out) and drafted > 0, params
        assert (out, drafted) == run(params), params


def test_recycler_is_fed_from_the_verdicts_topk():
    """After ar rounds, the recycler's top-1 successor of each fed token is the target's token
    that followed it (its latest occurrence), which only Verdict.topk carries to the engine."""
    eng = varied_engine()
    req = eng.generate(PROMPTS[1:2], dict(mode="ar", max_tokens=30))[0]
    fed = req.tokens[req.n_prompt - 1 : -1]  # the pending token of each round
    successor = {t: n for t, n in zip(fed, req.generated)}  # the latest occurrence wins
    assert {t: int(eng.recycler._table[t, 0]) for t in successor} == successor
    fresh = varied_engine()  # a scorer that reports no top-k: the recycler learns nothing
    fresh.scorer.topk = 0
    fresh.generate(PROMPTS[1:2], dict(mode="ar", max_tokens=5))
    assert fresh.recycler.nbytes == 0


def test_suffix_index_of_the_engine_stays_within_its_bound():
    base = varied_engine()
    eng = Engine(base.scorer, base.drafters["model"], base.tokenizer, max_model_len=256, suffix_max_tokens=200)
    eng.eos_ids = set()
    for _ in range(4):
        eng.generate(PROMPTS, dict(mode="spd", mla_sources=ALL_SOURCES, max_tokens=30))
        assert 0 < eng.draft_sources()["suffix"]["tokens"] <= 200
    nbytes = eng.draft_sources()["suffix"]["bytes"]
    eng.generate(PROMPTS, dict(mode="suffix", max_tokens=30))
    suffix = eng.draft_sources()["suffix"]
    assert suffix["bytes"] == nbytes  # fixed arrays: eviction, never growth
    assert suffix["sequences"] < 4 * len(PROMPTS)  # the oldest were evicted
    assert eng.suffix_index.propose(PROMPTS[3], 3) == VARIED_AR[3][:3]  # the newest is there


def test_auto_precision_follows_the_hardware(monkeypatch):
    from fly_serve.loading import loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: False)
    assert loading.resolve_precision("auto") == "fp32"  # emulated bf16 would make verification cost linear
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: True)
    assert loading.resolve_precision("auto") == "bf16"
    assert loading.resolve_precision("fp32") == "fp32" and loading.resolve_precision("int8") == "int8"
    assert loading.load_model("tiny:0", "auto").dtype == torch.float32
    with pytest.raises(ValueError, match="precision"):
        loading.load_model("tiny:0", "fp8")


SEEDED_MODES = [
    dict(mode="ar"),
    dict(mode="pld", k=4),
    dict(mode="spd", k=4),
    dict(mode="spd", k=8, mla=False),
    dict(mode="fly", k=6, theta=1.0),
    dict(mode="fly", k="auto", theta=1.0),
    dict(mode="suffix", k=4),
    dict(mode="recycle", k=4),
]


@pytest.mark.parametrize("loop", ["mla", "fixed"])
def test_a_seeded_request_gives_one_text_in_every_strict_mode_alone_and_in_a_batch(loop):
    """Issue 54, item 4: every sampled draw is keyed by (seed, position) and shared by drafter and
    target (sampling.py), so a seeded request at T = 1 emits the target's own draws whatever the
    mode, the drafts, k auto's choices, the batch beside it or the draft loop."""
    seeded = dict(temperature=1.0, seed=1234, max_tokens=30)
    others = [
        dict(mode="fly", k=5, theta=0.3, max_tokens=40),
        dict(mode="spd", k=3, temperature=0.7, seed=9, max_tokens=40),
    ]
    texts, drafted = set(), 0
    for params in SEEDED_MODES:
        eng = varied_engine(draft_loop=loop)
        alone = eng.generate([PROMPTS[2]], dict(seeded, **params))[0]
        batch = eng.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [others[0], dict(seeded, **params), others[1]])
        texts |= {tuple(alone.generated), tuple(batch[1].generated)}
        drafted += alone.stats.drafted + batch[1].stats.drafted
    assert len(texts) == 1 and drafted > 0
    assert len(set(next(iter(texts)))) > 5  # a sampled text, not one repeated token


def test_loose_decisions_at_a_temperature_keep_mismatches_with_the_keyed_draw():
    """FLy at T > 0: a mismatch is a draft that differs from the target's keyed draw; theta 0
    keeps some where the window agrees, reproducibly for one seed."""
    params = dict(mode="fly", k=6, theta=0.0, window=1, temperature=1.0, seed=3, max_tokens=40)
    first = varied_engine().generate(PROMPTS, params)
    again = varied_engine().generate(PROMPTS, params)
    assert [r.generated for r in first] == [r.generated for r in again]
    assert sum(r.stats.loosely_accepted for r in first) > 0


def test_a_plain_rounds_verdict_is_the_general_paths():
    """ModelScorer's own path for a round of plain greedy rows (no drafts, no grammar, no draw)
    gives the verdict the general path computes for it: rows of three lengths, then one more step."""
    from fly_serve.contracts import Drafts
    from fly_serve.runtime.model_scorer import ModelScorer

    own, general = (ModelScorer(Runner(TARGET, n_slots=3)) for _ in range(2))
    general.plain = lambda rows, drafts: False
    for step in range(2):
        rows = [Row(key=f"r{b}", tokens=p + [7] * step, k=0) for b, p in enumerate(PROMPTS[:3])]
        drafts = Drafts([[], [], []], [None] * 3)
        assert own.plain(rows, drafts) and not general.plain(rows, drafts)
        a, b = own.verify(rows, drafts), general.verify(rows, drafts)
        for field in ("ok", "y", "support", "topk"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y), field
        assert a.y.shape == (3, 1) and a.h is None and b.h is None and a.plausibility is None
        assert a.prefix_hit_tokens == b.prefix_hit_tokens
    sampled = [Row(key="r0", tokens=PROMPTS[0], k=0, temperature=1.0, seed=1)]
    assert not own.plain(sampled, Drafts([[]], [None])) and not own.plain(rows[:1], Drafts([[5]], [None]))


def test_a_batch_of_plain_rows_asks_k_auto_nothing():
    """mode ar with k "auto" in its defaults: nothing to choose, so the policy is not asked (its
    choice cost a plain step ~0.1 ms of host work); a k auto row beside them is."""
    eng = engine()
    asked = []
    choose = eng.policy.choose
    eng.policy.choose = lambda infos: asked.append(len(infos)) or choose(infos)
    out = [r.generated for r in eng.generate(PROMPTS[:2], dict(mode="ar", k="auto", max_tokens=8))]
    assert out == [g[:8] for g in AR[:2]] and asked == []
    eng.generate(PROMPTS[:1], dict(mode="fly", k="auto", max_tokens=4))
    assert asked and set(asked) == {1}
