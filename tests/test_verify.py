"""Batched verification == the scalar reference, on random inputs; sampling is lossless; the
plausibility guard (rho) and where the first loose accept sits, down to the engine on tiny models."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import fly_reference

from fly_serve.build import build_engine
from fly_serve.decision.sampling import keyed_draw, probs, seed_key, speculative_row
from fly_serve.decision.verify import (
    decide,
    greedy_check,
    plausibility_from_logits,
    plausibility_from_probs,
    plausible_mask,
    window_positions,
)
from fly_serve.decision.vocab_reads import argmax, entropy, gate_entropy, top_prob
from fly_serve.engine.params import ParamError, Params
from fly_serve.engine.request_stats import RequestStats
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer


@st.composite
def batches(draw):
    B = draw(st.integers(1, 6))
    K = draw(st.integers(0, 12))
    rows = []
    for _ in range(B):
        n = draw(st.integers(0, K))
        vocab = draw(st.integers(2, 4))  # a small vocabulary: several mismatches per row
        drafts = draw(st.lists(st.integers(0, vocab - 1), min_size=K, max_size=K))
        y = draw(st.lists(st.integers(0, vocab - 1), min_size=K + 1, max_size=K + 1))
        h = draw(st.lists(st.floats(0, 1, width=32), min_size=K, max_size=K))
        theta = draw(st.sampled_from([0.0, 0.3, 1.0]) | st.floats(0, 1, width=32))
        window = draw(st.integers(0, K + 1))
        support = draw(st.lists(st.booleans() | st.just(True), min_size=K, max_size=K))
        # The target's weights per position for the plausibility guard: small floats with ties and
        # zeros (the rule is scale-free, so no normalization), at least one positive per position.
        weight = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1, width=32)
        p = [draw(st.lists(weight, min_size=vocab, max_size=vocab)) for _ in range(K)]
        p = [w if max(w) > 0 else [1.0] + w[1:] for w in p]
        rho = draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1, width=32))
        rows.append((n, drafts, y, h, theta, window, support, p, rho))
    return K, rows, draw(st.sampled_from(["paper", "authors"]))


def weights_tensor(rows, K: int) -> torch.Tensor:
    """[B, K, max vocab] float64 (exact for the float32 draws), zero past a row's vocabulary."""
    V = max((len(w) for r in rows for w in r[7]), default=1)
    out = torch.zeros(len(rows), K, V, dtype=torch.float64)
    for b, r in enumerate(rows):
        for i, w in enumerate(r[7]):
            out[b, i, : len(w)] = torch.tensor(w, dtype=torch.float64)
    return out


@settings(max_examples=400, deadline=None)
@given(batches())
def test_decide_matches_reference(batch):
    K, rows, rule = batch
    n = torch.tensor([r[0] for r in rows])
    drafts = torch.tensor([r[1] for r in rows], dtype=torch.long).reshape(len(rows), K)
    y = torch.tensor([r[2] for r in rows], dtype=torch.long)
    h = torch.tensor([r[3] for r in rows], dtype=torch.float).reshape(len(rows), K)
    theta = torch.tensor([r[4] for r in rows], dtype=torch.float)
    check, span = (torch.tensor(v) for v in zip(*(window_positions(r[5], rule) for r in rows)))
    support = torch.tensor([r[6] for r in rows], dtype=torch.bool).reshape(len(rows), K)
    ok = (drafts == y[:, :-1]) & (torch.arange(K)[None] < n[:, None])
    rho = torch.tensor([r[8] for r in rows], dtype=torch.float64)
    guard = plausible_mask(plausibility_from_probs(weights_tensor(rows, K), drafts), rho)
    accept_len, loosely = decide(ok, h, n, theta, check, span, support, guard)
    for b, (nb, d, yb, hb, th, w, sup, p, r) in enumerate(rows):
        emitted, kept, n_loose = fly_reference(d, yb, hb, nb, th, w, rule, sup, p, r)
        a = int(accept_len[b])
        assert a == kept
        assert d[:a] + [yb[a]] == emitted
        assert int(loosely[b].sum()) == n_loose


def test_special_values():
    # d = [1, 9, 3, 4, 5], target [1, 2, 3, 4, 5, 6]: one mismatch at position 2, clean window.
    ok = torch.tensor([[True, False, True, True, True]])
    n = torch.tensor([5])
    unsure = torch.full((1, 5), 0.5)
    sure = torch.full((1, 5), 0.1)

    def run(h, theta, w, support=None):
        return int(decide(ok, h, n, torch.tensor([theta]), torch.tensor([w]), support=support)[0])

    assert run(unsure, 0.3, 3) == 5  # loosely accepted, then the bonus
    assert run(sure, 0.3, 3) == 1  # the gate: the target is sure, reject
    assert run(sure, 0.0, 3) == 5  # theta = 0 defers every mismatch
    assert run(unsure, 1.0, 3) == 1  # theta >= 1: standard speculative decoding
    assert run(unsure, 0.3, 4) == 1  # the window would reach past K: reject
    assert run(unsure, 0.3, 0) == 5  # W = 0 accepts every deferred mismatch
    outside = torch.tensor([[True, False, True, True, True]])  # p(d_2) = 0: outside the nucleus
    assert run(unsure, 0.3, 3, support=outside) == 1


def random_round(seed: int, B: int = 64, K: int = 8, V: int = 4, levels: int = 3):
    """Greedy logits with many ties (integer values in [0, levels)) and random drafts: the
    target's check of a round where every mismatch is unsure and the window is W = 0, so only
    the guard can stop a deferral."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (B, K + 1, V), generator=g).float()
    drafts = torch.randint(0, V, (B, K), generator=g)
    n = torch.full((B,), K)
    ok, y = greedy_check(logits, drafts, n)
    loose = dict(h=torch.ones(B, K), n=n, theta=torch.zeros(B), check=torch.zeros(B, dtype=torch.long))
    return logits, drafts, ok, y, loose


def test_plausibility_from_logits_is_the_softmax_ratio():
    logits, drafts, _, y, _ = random_round(0, levels=50)
    logits = logits / 7  # not integers: a real ratio, not just 1 or e^-k
    p = torch.softmax(logits[:, :-1], -1)
    expected = p.gather(-1, drafts[..., None]).squeeze(-1) / p.max(-1).values
    assert torch.allclose(plausibility_from_logits(logits, drafts, y), expected, atol=1e-6)
    assert torch.allclose(plausibility_from_probs(p, drafts), expected, atol=1e-6)


def test_rho_one_defers_only_drafts_tied_with_the_argmax():
    logits, drafts, ok, y, loose = random_round(1)
    tied = logits[:, :-1].gather(-1, drafts[..., None]).squeeze(-1) == logits[:, :-1].max(-1).values
    guard = plausible_mask(plausibility_from_logits(logits, drafts, y), torch.ones(len(drafts)))
    accept_len, loosely = decide(ok, **loose, plausible=guard)
    assert loosely.any() and (tied[loosely]).all()  # some ties were kept, nothing else
    # each row stops exactly at its first mismatch whose draft is not tied with the argmax
    untied_miss = torch.cat([~ok & ~tied, torch.ones(len(drafts), 1, dtype=torch.bool)], 1)
    assert accept_len.tolist() == untied_miss.int().argmax(1).tolist()
    unguarded = decide(ok, **loose)[1]
    assert (unguarded & ~tied).any()  # the guard is what removed them


@pytest.mark.parametrize("seed", range(5))
def test_rho_zero_changes_nothing(seed):
    logits, drafts, ok, y, loose = random_round(seed, levels=50)
    logits[:, :, 0] = float("-inf")  # a token with p = 0: ratio 0 still passes rho = 0
    B, K = drafts.shape
    ok, y = greedy_check(logits, drafts, loose["n"])
    g = torch.Generator().manual_seed(seed)
    loose.update(h=torch.rand(B, K, generator=g), theta=torch.rand(B, generator=g) * 0.5)
    loose.update(check=torch.randint(0, 3, (B,), generator=g))
    guard = plausible_mask(plausibility_from_logits(logits, drafts, y), torch.zeros(B))
    assert guard.all()
    without, with_zero = decide(ok, **loose), decide(ok, **loose, plausible=guard)
    assert torch.equal(without[0], with_zero[0]) and torch.equal(without[1], with_zero[1])


def test_first_loose_position_counts_only_tokens_that_reached_the_output():
    stats = RequestStats()
    stats.note_loose(5, torch.tensor([False, True, True]), committed=1)  # cut before the loose draft
    assert stats.first_loose_pos is None
    stats.note_loose(7, torch.tensor([False, False, True, True]), committed=5)
    assert stats.first_loose_pos == 9
    stats.note_loose(12, torch.tensor([True]), committed=2)  # a later one does not move it
    assert stats.first_loose_pos == 9 and stats.as_dict()["first_loose_pos"] == 9


# ---- the engine on tiny random models (fp32)
# A tied-embedding random model mostly predicts its input token again, so two of them agree on
# nearly every token; an untied drafter proposes tokens of its own, which FLy can then defer.
TARGET, DRAFTER = tiny_model(seed=0), tiny_model(seed=1, num_hidden_layers=1, tie_word_embeddings=False)
PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13, 21)]


def run_engine(**params):
    """The four prompts as one batch, 30 tokens each (fly tests pass mla=False: the random target
    repeats itself, and prompt lookup would draft it exactly, leaving nothing to defer)."""
    eng = build_engine(TARGET, DRAFTER, tokenizer=tiny_tokenizer(), max_model_len=256)
    eng.eos_ids = set()  # random models: run every request to max_tokens
    return eng.generate(PROMPTS, dict(max_tokens=30, **params))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_engine_guard_and_first_loose_position():
    ar = [r.generated for r in run_engine(mode="ar")]
    fly = dict(mode="fly", theta=0.0, window=0, mla=False)
    loose = run_engine(**fly)
    assert sum(r.stats.loosely_accepted for r in loose) > 0
    # Greedy: every token before the first loose accept is the target's own, so the first loose
    # accept is exactly where the output parts from ar's.
    for r, want in zip(loose, ar):
        assert r.stats.first_loose_pos == first_divergence(r.generated, want)
        assert (r.stats.first_loose_pos is None) == (r.stats.loosely_accepted == 0)
    # rho = 1: random fp32 logits have no ties, so nothing is deferred and fly is exact
    guarded = run_engine(**fly, rho=1.0)
    assert [r.generated for r in guarded] == ar
    assert all(r.stats.loosely_accepted == 0 and r.stats.first_loose_pos is None for r in guarded)
    # rho = 0 is the default: the same outputs as without it
    assert [r.generated for r in run_engine(**fly, rho=0.0)] == [r.generated for r in loose]
    # a guard almost every draft passes defers like none: the scorer reported the ratio (a
    # missing one would leave the guarded rows strict, with ar's outputs)
    assert [r.generated for r in run_engine(**fly, rho=1e-9)] == [r.generated for r in loose]


class GuardAfter:
    """The real scorer, but its plausibility says "implausible" everywhere for the first `strict`
    rounds and "tied with the top" after: with rho = 1 those rounds are strict, the later ones
    defer every mismatch, so the first loose accept comes in a later round."""

    def __init__(self, scorer, strict: int):
        self.scorer, self.strict, self.calls = scorer, strict, 0
        self.vocab_size = scorer.vocab_size

    def verify(self, rows, drafts):
        self.calls += 1
        verdict = self.scorer.verify(rows, drafts)
        fill = torch.zeros_like if self.calls <= self.strict else torch.ones_like
        return dataclasses.replace(verdict, plausibility=fill(verdict.plausibility))

    def release(self, keys):
        self.scorer.release(keys)


def test_engine_first_loose_position_in_a_later_round():
    ar = [r.generated for r in run_engine(mode="ar")]
    eng = build_engine(TARGET, DRAFTER, tokenizer=tiny_tokenizer(), max_model_len=256)
    eng.eos_ids = set()
    eng.scorer = GuardAfter(eng.scorer, strict=2)
    reqs = eng.generate(PROMPTS, dict(max_tokens=30, mode="fly", theta=0.0, window=0, mla=False, rho=1.0))
    for r, want in zip(reqs, ar):
        assert r.stats.first_loose_pos == first_divergence(r.generated, want)
        assert r.stats.first_loose_pos >= 2  # two strict rounds emitted at least a token each


def test_engine_guard_at_temperature():
    params = dict(mode="fly", theta=0.0, window=0, mla=False, temperature=1.0, seed=3)
    loose = sum(r.stats.loosely_accepted for r in run_engine(**params))
    # a draft the target ranks first may still fail the p/q test at T > 0: rho = 1 keeps only those
    assert 0 <= sum(r.stats.loosely_accepted for r in run_engine(**params, rho=1.0)) < loose


def test_rho_is_validated():
    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(ParamError, match="rho: must be in"):
            Params(rho=bad).validate(1, 1000)
    assert Params(rho=0.5).validate(1, 1000).rho == 0.5


def test_authors_window_checks_w_minus_1_but_needs_a_full_window():
    """K = 15, W = 6, one unsure mismatch at j = 10: the authors' code needs j + W <= K, so it
    rejects there (keeps 9) although only W - 1 = 5 positions follow the mismatch."""
    K = 15
    ok = torch.ones(1, K, dtype=torch.bool)
    ok[0, 9] = False  # j = 10
    h, n, theta = torch.full((1, K), 0.5), torch.tensor([K]), torch.tensor([0.3])
    for rule, kept in (("authors", 9), ("paper", 9)):
        check, span = window_positions(6, rule)
        assert int(decide(ok, h, n, theta, torch.tensor([check]), torch.tensor([span]))[0]) == kept
    check, span = window_positions(6, "authors")
    assert (check, span) == (5, 6)
    ok[0, 9], ok[0, 8] = True, False  # j = 9: j + W = 15 <= K, the window fits
    assert int(decide(ok, h, n, theta, torch.tensor([check]), torch.tensor([span]))[0]) == K


def test_entropies():
    uniform = torch.full((2, 1000), 1e-3)
    assert torch.allclose(entropy(uniform, "full"), torch.ones(2))  # normalized: max is 1
    peaked = torch.softmax(torch.tensor([[10.0, 0, 0, 0]]), -1)
    assert entropy(peaked, "full") < 0.01 and entropy(peaked, "topk") < 0.01
    three = torch.tensor([[1 / 3] * 3 + [0.0] * 97])
    assert torch.allclose(entropy(three, "topk"), torch.log(torch.tensor([3.0])), atol=1e-5)
    assert torch.allclose(entropy(three, "full"), torch.log(torch.tensor([3.0])) / torch.log(torch.tensor(100.0)))


def test_gate_reads_the_processed_distribution():
    """At T > 0 the entropy is of the tempered, top-p distribution: a low temperature makes the
    same logits sure, a nucleus cut leaves only the kept tokens."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5])
    assert entropy(probs(logits, 0.1), "topk") < 0.1 < entropy(probs(logits, 1.0), "topk")
    assert entropy(probs(logits, 1.0, top_p=0.4), "topk") == 0  # one token left


def test_greedy_check():
    logits = torch.tensor([[[0, 5.0, 0], [3.0, 0, 0], [0, 0, 1.0]]])  # target says 1, 0, 2
    ok, y = greedy_check(logits, torch.tensor([[1, 2]]), torch.tensor([2]))
    assert ok.tolist() == [[True, False]] and y.tolist() == [[1, 0, 2]]
    ok, _ = greedy_check(logits, torch.tensor([[1, 0]]), torch.tensor([1]))
    assert ok.tolist() == [[True, False]]  # past n: never ok


def test_speculative_sampling_is_lossless():
    """The token emitted at the first position is distributed as p whatever q is."""
    g = torch.Generator().manual_seed(0)
    V, N = 5, 20000
    p_logits = torch.tensor([[1.0, 0.2, -1.0, 0.5, 0.0], [0.0] * 5])
    q = torch.softmax(torch.tensor([[-1.0, 1.0, 0.3, 0.0, 2.0]]), -1)
    p = probs(p_logits[0], 1.0)
    counts = torch.zeros(V)
    for _ in range(N):
        d = torch.multinomial(q[0], 1, generator=g)
        ok, y = speculative_row(probs(p_logits, 1.0), d, 1, q, g)
        counts[int(d) if ok[0] else int(y[0])] += 1
    assert (counts / N - p).abs().max() < 0.015


def signed(key: int) -> int:
    return key - 2**64 if key >= 2**63 else key


def test_keyed_draws_are_distributed_as_p_and_independent_of_the_draft():
    """The keyed draw at a position (a hash of seed, position and token id: sampling.keyed_draw)
    is distributed as p over seeds; a draft is accepted iff it equals the draw, so the emitted
    token is the draw whatever the draft was (what makes a seeded request repeat in every mode)."""
    V, N = 5, 20000
    p = probs(torch.tensor([1.0, 0.2, -1.0, 0.5, 0.0]), 1.0)
    keys = torch.tensor([signed(seed_key(seed)) for seed in range(N)])
    drawn = keyed_draw(p.expand(N, V), keys, torch.full((N,), 2))
    assert (torch.bincount(drawn, minlength=V) / N - p).abs().max() < 0.015
    emitted = [[d if d == int(drawn[s]) else int(drawn[s]) for d in range(V)] for s in range(50)]
    assert all(len(set(e)) == 1 for e in emitted)
    # positions and seeds give unrelated numbers; the same key and position the same draw
    at3 = keyed_draw(p.expand(N, V), keys, torch.full((N,), 3))
    assert 0.2 < float((at3 == drawn).float().mean()) < 0.45  # sum p^2 = 0.32 for independent draws
    assert torch.equal(drawn, keyed_draw(p.expand(N, V), keys, torch.full((N,), 2)))


def test_keyed_draws_are_chunked_without_changing_them(monkeypatch):
    from fly_serve.decision import sampling

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, 300, generator=g), -1)
    keys, pos = torch.randint(-(2**62), 2**62, (40,), generator=g), torch.arange(40) * 7
    whole = keyed_draw(p, keys, pos)
    monkeypatch.setitem(sampling.CHUNK, "cpu", 600)  # two rows a chunk
    assert torch.equal(keyed_draw(p, keys, pos), whole)


def test_coupled_drafts_are_accepted_between_the_coupling_bounds():
    """A draft drawn from q with the target's own numbers is accepted with probability between
    (1 - TV) / (1 + TV) and 1 - TV (speculative sampling's p/q test: 1 - TV)."""
    V, N = 6, 20000
    p = probs(torch.tensor([1.0, 0.2, -1.0, 0.5, 0.0, 0.3]), 1.0)
    q = probs(torch.tensor([0.6, 0.5, -0.5, 0.2, 0.1, 0.9]), 1.0)
    tv = float((p - q).abs().sum() / 2)
    keys, pos = torch.tensor([signed(seed_key(s)) for s in range(N)]), torch.full((N,), 9)
    accepted = float((keyed_draw(p.expand(N, V), keys, pos) == keyed_draw(q.expand(N, V), keys, pos)).float().mean())
    assert (1 - tv) / (1 + tv) - 0.01 < accepted < 1 - tv + 0.01


def test_top_p():
    p = probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.7)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))


def test_the_host_argmax_is_torchs_on_ties_nan_inf_and_views():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 1000, generator=g)
    x[0, 0, [7, 500]] = 9.0  # a tie: the first index
    x[0, 1, :] = float("-inf")  # a fully masked position
    x[1, 2, 300] = float("nan")  # NaN counts as the maximum
    for t in (x, x[..., :900], x[:, 1:3], x[0, 2], x.to(torch.float64)):  # views, 1-D, a dtype numpy is not given
        assert torch.equal(argmax(t), t.argmax(-1))
    assert argmax(x).dtype == torch.int64


def test_the_gate_entropy_is_computed_at_the_mismatches_the_gate_reads():
    g = torch.Generator().manual_seed(4)
    B, K, V = 3, 5, 400
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    y = argmax(logits)
    drafted = y[:, :K].clone()
    for b, i in [(0, 1), (0, 3), (2, 4)]:
        drafted[b, i] = (drafted[b, i] + 1) % V
    n = torch.tensor([5, 5, 3])  # row 2's mismatch lies past its drafts
    h = torch.full((B, K), -1.0)
    gate_entropy(logits, drafted, y, n, [0, 2], "topk", h)
    full = entropy(torch.softmax(logits[:, :K], -1), "topk")
    assert torch.equal(h[0, [1, 3]], full[0, [1, 3]])  # the same numbers the full softmax gives there
    untouched = torch.ones(B, K, dtype=torch.bool)
    untouched[0, [1, 3]] = False
    assert (h[untouched] == -1).all()  # matches, a row not asked for, a position past n
    # decide reads the same verdict either way: h elsewhere is never read
    ok = (drafted == y[:, :K]) & (torch.arange(K)[None, :] < n[:, None])
    theta, check = torch.full((B,), 0.5), torch.ones(B, dtype=torch.long)
    for a, b in zip(decide(ok, h, n, theta, check), decide(ok, full, n, theta, check)):
        assert torch.equal(a, b)


def test_top_prob_is_the_softmax_maximum():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 2000, generator=g) * 5
    x[0, 0, :] = float("-inf")
    x[0, 0, 9] = 1.0  # one token left: certain
    assert torch.allclose(top_prob(x), torch.softmax(x, -1).amax(-1), rtol=1e-5)
    assert float(top_prob(x)[0, 0]) == 1.0
