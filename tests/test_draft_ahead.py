"""Draft-ahead (fly_serve/drafting/draft_ahead.py): the drafter drafts round r+1 while the target verifies
round r. It changes when drafts are made, never which tokens come out: every test compares the
draft-ahead engine with the sequential one token for token, on tiny random models, with bets
both won and lost (a drafter close to the target wins some; the target as its own drafter wins
most at T = 0)."""

import pytest
import torch
from test_engine import PROMPTS, VARIED, _noisy_copy

from deployments.parts.row_history import RowHistory, RowSender
from fly_serve.build import build_engine
from fly_serve.contracts import Row
from fly_serve.drafting.draft_ahead import Stages
from fly_serve.drafting.drafters import ModelDrafter
from fly_serve.k_auto.allocator import RowInfo, plan
from fly_serve.k_auto.round_cost import MODEL, RoundCostModel
from fly_serve.loading.tiny import tiny_tokenizer
from fly_serve.runtime.runner import Runner

CLOSE = _noisy_copy(VARIED, 0.003)  # agrees with the target often enough to win bets and lose some


def engine(ahead: bool, drafter=CLOSE, **kw):
    eng = build_engine(VARIED, drafter, tokenizer=tiny_tokenizer(), max_model_len=256, draft_ahead=ahead, **kw)
    eng.eos_ids = set()  # random models: run every request to max_tokens
    return eng


def run(ahead: bool, params, prompts=PROMPTS, drafter=CLOSE):
    per = params if isinstance(params, list) else [params] * len(prompts)
    eng = engine(ahead, drafter)
    reqs = eng.generate(prompts, [dict(max_tokens=24, **p) for p in per])
    return [r.generated for r in reqs], reqs


def hits(reqs) -> tuple[int, int]:
    return sum(r.stats.ahead_hits for r in reqs), sum(r.stats.ahead_misses for r in reqs)


MODES = [
    dict(mode="spd", k=4),
    dict(mode="spd", k=3, mla=False),
    dict(mode="fly", theta=0.0, window=1, k=4),  # loosely accepts: keeps more rounds whole
    dict(mode="fly", k=6),
]


@pytest.mark.parametrize("params", MODES)
def test_greedy_outputs_equal_the_sequential_engine(params):
    seq, _ = run(False, params)
    out, reqs = run(True, params)
    assert out == seq
    won, lost = hits(reqs)
    assert won > 0 and lost > 0  # both ways of settling a bet ran


@pytest.mark.parametrize(
    "params",
    [
        dict(mode="fly", k=6, temperature=0.9, seed=3),
        dict(mode="spd", k=3, temperature=0.8, top_p=0.9, seed=1, mla=False),
        dict(mode="fly", theta=0.0, window=1, k=4, temperature=0.7, seed=11),
    ],
)
def test_seeded_sampling_equals_the_sequential_engine(params):
    """T > 0: keyed draws, so a lost bet leaves the drafter's drafts as the sequential one's."""
    seq, _ = run(False, params, drafter=VARIED)
    out, reqs = run(True, params, drafter=VARIED)
    assert out == seq
    won, lost = hits(reqs)
    assert won > 0 and lost > 0


def test_a_mixed_batch_equals_each_request_alone_and_sequential():
    """Every mode in one batch (the model-free ones do not bet: they draft in microseconds), each
    equal to the sequential engine's batch and to the request run alone with draft-ahead."""
    mixed = [
        dict(mode="spd", k=4),
        dict(mode="fly", theta=0.0, window=1, k=5, temperature=0.8, seed=4),
        dict(mode="pld", k=4),
        dict(mode="ar"),
        dict(mode="fly", k=3),
        dict(mode="spd", k=4, mla_sources="pld,recycle"),  # a shared MLA source: no bet
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mixed))]
    seq, _ = run(False, mixed, prompts)
    out, reqs = run(True, mixed, prompts)
    assert out == seq
    for prompt, params, together in zip(prompts, mixed, out):
        assert run(True, params, [prompt])[0] == [together]
    assert all(r.stats.ahead_hits + r.stats.ahead_misses == 0 for r in reqs[2:4] + reqs[5:])
    assert sum(hits(reqs[:2] + reqs[4:5])) > 0


def test_auto_k_greedy_equals_ar_and_bets():
    """k "auto" chooses a row's next k before its verdict (the bet's k stands), so its ks may
    differ from the sequential engine's; spd at T = 0 is the target's greedy text whatever k."""
    ar, _ = run(False, dict(mode="ar"))
    out, reqs = run(True, dict(mode="spd", k="auto", k_max=6))
    assert out == ar
    assert sum(hits(reqs)) > 0


def test_counters_add_up():
    eng = engine(True)
    reqs = [eng.add(p, dict(mode="fly", theta=0.0, window=1, k=4, max_tokens=24)) for p in PROMPTS]
    total = dict(hits=0, misses=0, dropped=0, drafted=0)
    while eng.has_work():
        r = eng.step()
        assert r.ahead_dropped <= r.ahead_drafted and r.ahead_hits + r.ahead_misses <= r.batch_size
        assert r.ahead_s > 0 and r.verify_wait_s >= 0 and r.draft_wait_s >= 0
        assert min(r.verify_wait_s, r.draft_wait_s) == 0  # one side waits for the other, not both
        for name in total:
            total[name] += getattr(r, f"ahead_{name}")
    assert total["hits"] == sum(r.stats.ahead_hits for r in reqs) > 0
    assert total["misses"] == sum(r.stats.ahead_misses for r in reqs) > 0
    assert total["dropped"] == sum(r.stats.ahead_dropped for r in reqs) > 0
    assert not eng.pipeline.ahead  # finished rows leave nothing behind


class FlakyAhead:
    """A model drafter whose ahead calls (Row.peek) fail every other time, before drafting or
    after it (the answer lost on the way back), like a remote drafter that times out."""

    def __init__(self, inner: ModelDrafter):
        self.inner, self.calls, self.failed = inner, 0, 0

    def propose(self, rows):
        if any(r.peek for r in rows):
            self.calls += 1
            if self.calls % 4 == 1:
                self.failed += 1
                raise RuntimeError("drafter gone before drafting")
            if self.calls % 4 == 3:
                self.inner.propose(rows)
                self.failed += 1
                raise RuntimeError("answer lost after drafting")
        return self.inner.propose(rows)

    def release(self, keys):
        self.inner.release(keys)

    def share_sources(self, sources):
        self.inner.share_sources(sources)


@pytest.mark.parametrize(
    "params", [dict(mode="fly", theta=0.0, window=1, k=4), dict(mode="fly", k=5, temperature=0.9, seed=3)]
)
def test_a_failing_ahead_call_falls_back_to_drafting_in_the_round(params):
    """A failed bet fails no round: its rows draft as usual next round, and the outputs (and, at
    T > 0, the drafter's draws) are still the sequential engine's."""
    drafter = CLOSE if params.get("temperature", 0) == 0 else VARIED
    seq, _ = run(False, params, drafter=drafter)
    eng = engine(True, drafter)
    flaky = eng.drafters["model"] = FlakyAhead(eng.drafters["model"])
    reqs = eng.generate(PROMPTS, dict(max_tokens=24, **params))
    assert [r.generated for r in reqs] == seq
    assert flaky.failed >= 2 and all(r.finish_reason == "length" for r in reqs)
    assert sum(hits(reqs)) > 0


def test_a_lost_bet_leaves_no_trace_in_the_drafters_draws():
    """The drafter alone: a bet's drafts then a call whose tokens leave the guess draws exactly
    what a drafter that never bet draws (keyed draws: a position's numbers do not depend on the
    draws before it), and ships no q (the target compares tokens)."""
    tokens = PROMPTS[2]

    def drafter():
        return ModelDrafter(Runner(VARIED, n_slots=2))

    row = dict(key="r", k=4, temperature=0.9, seed=5)
    plain = drafter().propose([Row(tokens=tokens + [7, 8], **row)])
    betting = drafter()
    bet = betting.propose([Row(tokens=tokens, peek=True, **row)])
    assert bet.guesses[0] is not None and len(bet.tokens[0]) == 4
    again = betting.propose([Row(tokens=tokens + [7, 8], **row)])  # the verdict left the guess
    assert again.tokens == plain.tokens and again.q == plain.q == [None]


def test_a_sender_counts_a_bets_guessed_tail_as_unsent():
    """Through a remote drafter, rows go as suffixes (row_history.py). A bet's row carries this
    round's drafts; they may be replaced, so the next call resends from before them."""
    sender, receiver = RowSender(), RowHistory()
    committed = [1, 2, 3, 4]
    bet = Row("r", committed + [9, 9], k=2, peek=True, guessed=2)
    receiver.whole(sender.compact([bet]))
    sender.sent([bet])
    lost = Row("r", committed + [5], k=2)  # the verdict kept none of the drafts
    assert receiver.whole(sender.compact([lost]))[0].tokens == committed + [5]


def test_stages_run_on_their_own_thread_budgets():
    stages = Stages(draft_threads=1, verify_threads=2)
    try:
        assert stages.draft(torch.get_num_threads) == 1
        both = stages.together(torch.get_num_threads, torch.get_num_threads)
        assert (both.verdict, both.ahead) == (2, 1)
        assert min(both.verify_wait_s, both.draft_wait_s) == 0
    finally:
        stages.close()


def test_overlapped_cost_picks_k_where_drafting_meets_verification():
    """k "auto" with draft-ahead: drafting up to the verify time is nearly free (only lost bets
    redraft), past it every draft costs its whole time. With verify flat at 1 s and a drafter
    forward of 0.1 s, the plan drafts about as long as the target verifies (the sequential plan
    drafts longer: its drafts cost their time whatever k)."""
    profile = {
        "verify": {"tokens": [1, 64], "seconds": [1.0, 1.0]},
        "draft": {"per_round": 0.0, "per_forward": 0.1, "per_row_forward": 0.0},
    }
    cost = RoundCostModel(profile)
    rows = [RowInfo("r", 30, MODEL, acceptance=0.97)]
    overlapped, sequential = plan(rows, cost, overlap=True), plan(rows, cost)
    together = overlapped.ks[0]
    assert 8 <= together <= 10  # the peek and k forwards: 0.1 * (k + 1) s against 1 s of verify
    assert overlapped.rate > 1.3 * sequential.rate
    # and the predicted round agrees: past the meeting point a draft costs its whole 0.1 s
    at = lambda k: cost.round_s([k], rows, overlap=True)  # noqa: E731
    assert at(together + 4) - at(together + 3) > 0.09 and at(4) - at(3) < 0.05


class FailingEveryThirdVerify:
    """The real scorer whose every third verify fails (the round is retried while its ahead
    drafts were made, and the drafts it held from the round before are used again)."""

    def __init__(self, scorer):
        self.scorer, self.calls, self.failed, self.vocab_size = scorer, 0, 0, scorer.vocab_size

    def verify(self, rows, drafts):
        self.calls += 1
        if self.calls % 3 == 0:
            self.failed += 1
            raise RuntimeError("injected fault")
        return self.scorer.verify(rows, drafts)

    def release(self, keys):
        self.scorer.release(keys)


@pytest.mark.parametrize("params", [dict(mode="fly", theta=0.0, window=1, k=4), dict(mode="spd", k=3)])
def test_a_failed_verify_is_retried_with_the_same_bets(params):
    """Greedy: a retried round drafts again in the sequential engine too, so at T > 0 a retry
    draws anew in either engine (as before draft-ahead) and only greedy outputs are compared."""
    seq, _ = run(False, params)
    eng = engine(True)
    eng.scorer = FailingEveryThirdVerify(eng.scorer)
    reqs = eng.generate(PROMPTS, dict(max_tokens=24, **params))
    assert [r.generated for r in reqs] == seq and eng.scorer.failed >= 2
    assert sum(hits(reqs)) > 0


def test_a_held_bet_that_no_longer_continues_the_tokens_is_dropped():
    """A round that fails after some rows committed is retried; a row whose held drafts were
    made for tokens it no longer ends with drafts again rather than reuse them (review finding)."""
    eng = engine(True, drafter=VARIED)  # the target as its own drafter: bets win
    req = eng.add(PROMPTS[0], dict(mode="spd", k=4, max_tokens=60))
    ahead = eng.pipeline.ahead
    while req.id not in ahead and not req.finished:
        eng.step()
    assert req.id in ahead
    rows = [eng._row(req)]
    assert eng.pipeline.held([req], rows)[0] is ahead[req.id]  # held as made
    req.tokens.append(req.tokens[-1])  # the row moved on without a settle (a partial commit)
    assert eng.pipeline.held([req], [eng._row(req)]) == [None]
