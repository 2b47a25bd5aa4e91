"""Batched verification == the scalar reference, on random inputs; sampling is lossless."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import fly_reference

from fly_serve.sampling import probs, speculative_row
from fly_serve.verify import decide, entropy, greedy_check, window_positions


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
        rows.append((n, drafts, y, h, theta, window, support))
    return K, rows, draw(st.sampled_from(["paper", "authors"]))


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
    accept_len, loosely = decide(ok, h, n, theta, check, span, support)
    for b, (nb, d, yb, hb, th, w, sup) in enumerate(rows):
        emitted, kept, n_loose = fly_reference(d, yb, hb, nb, th, w, rule, sup)
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


def test_top_p():
    p = probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.7)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
