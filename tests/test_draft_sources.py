"""Model-free draft sources: the suffix index over earlier requests and token recycling."""

import random
import time
from collections import Counter

import numpy as np
import pytest
import torch

from fly_serve.contracts import Drafts, Row
from fly_serve.drafting.drafters import ModelDrafter, SourceDrafter
from fly_serve.drafting.suffix_index import SuffixIndex, _bucket, _buckets, _window_hashes
from fly_serve.drafting.token_recycling import TokenRecycling
from fly_serve.k_auto.allocator import RowInfo, plan
from fly_serve.k_auto.round_cost import PLD, RECYCLE, SUFFIX, RoundCostModel
from fly_serve.loading.tiny import tiny_model
from fly_serve.runtime.model_scorer import ModelScorer
from fly_serve.runtime.runner import Runner

# ---- SuffixIndex ---------------------------------------------------------------------------


def test_proposes_continuation_of_earlier_sequence():
    index = SuffixIndex(max_tokens=1000)
    index.add(list(range(100, 120)))
    assert index.propose([7, 7, 105, 106, 107], 4) == [108, 109, 110, 111]


def test_continuation_stops_at_sequence_end():
    index = SuffixIndex(max_tokens=1000)
    index.add([1, 2, 3, 4])
    index.add([50, 51, 52])  # must not be offered as what follows [.., 3, 4]
    assert index.propose([2, 3], 10) == [4]


def test_prefers_longer_match():
    index = SuffixIndex(max_tokens=1000)
    index.add([10, 1, 2, 3, 50, 51])
    index.add([20, 2, 3, 60, 61])  # newer, but shares only [2, 3] with the context
    assert index.propose([10, 1, 2, 3], 2) == [50, 51]
    assert index.propose([20, 2, 3], 2) == [60, 61]


def test_prefers_more_frequent_continuation():
    index = SuffixIndex(max_tokens=1000)
    for _ in range(3):
        index.add([1, 2, 3, 7, 8])
    index.add([1, 2, 3, 9, 9])  # the newest, but outvoted
    assert index.propose([1, 2, 3], 2) == [7, 8]


def test_vote_continues_among_agreeing_occurrences():
    index = SuffixIndex(max_tokens=1000)
    index.add([4, 5, 6, 30, 31])
    index.add([4, 5, 6, 30, 32])
    index.add([4, 5, 6, 30, 32])
    index.add([4, 5, 6, 40, 41])
    assert index.propose([4, 5, 6], 2) == [30, 32]


def test_tie_goes_to_newest():
    index = SuffixIndex(max_tokens=1000)
    index.add([1, 2, 3, 7])
    index.add([1, 2, 3, 9])
    assert index.propose([1, 2, 3], 1) == [9]


def test_no_match_or_nothing_asked():
    index = SuffixIndex(max_tokens=1000)
    assert index.propose([1, 2, 3], 4) == []  # empty index
    index.add([1, 2, 3, 4, 5])
    assert index.propose([8, 9], 4) == []
    assert index.propose([3], 4) == []  # shorter than min_n
    assert index.propose([1, 2, 3], 0) == []
    assert index.propose([], 4) == []


def _reference_first_tokens(sequences, context, max_n, min_n):
    """Brute force: the most frequent next tokens after the longest match (>= min_n, <= max_n)
    of the context's suffix in the sequences."""
    tail = context[-max_n:]
    best, counts = 0, Counter()
    for seq in sequences:
        for end in range(len(seq) - 1):
            m = 0
            while m < len(tail) and m <= end and seq[end - m] == tail[-1 - m]:
                m += 1
            if m < min_n or m < best:
                continue
            if m > best:
                best, counts = m, Counter()
            counts[seq[end + 1]] += 1
    if not counts:
        return set()
    top = max(counts.values())
    return {t for t, c in counts.items() if c == top}


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force_with_eviction(seed):
    rng = random.Random(seed)
    max_tokens, max_n, min_n = 300, 6, 2
    # Unbounded chains (max_candidates) make the index exact, so a brute force can check it.
    index = SuffixIndex(max_tokens=max_tokens, max_n=max_n, min_n=min_n, max_candidates=10**6)
    live: list[list[int]] = []
    for _ in range(60):
        seq = [rng.randrange(6) for _ in range(rng.randrange(3, 40))]
        index.add(seq)
        live.append(seq)
        while sum(len(s) + 1 for s in live) > max_tokens:  # one separator slot per sequence
            live.pop(0)
        assert index.num_sequences == len(live)
        assert index.num_tokens == sum(map(len, live)) <= max_tokens
        for _ in range(5):
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
            k = rng.randrange(0, 6)
            draft = index.propose(context, k)
            assert len(draft) <= k
            expected = _reference_first_tokens(live, context, max_n, min_n) if k else set()
            if expected:
                assert draft and draft[0] in expected
            else:
                assert draft == []


def test_propose_hash_agrees_with_add_hash():
    """propose hashes the context in Python ints, add hashes windows in numpy: they must agree
    bit for bit, large ids and 64-bit wraparound included."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 8):
        windows = rng.integers(0, 2**31 - 1, size=(50, n))
        for w in windows:
            assert _bucket(w.tolist(), 19) == int(_buckets(_window_hashes(w, n), 19)[0])


def test_memory_bound_evicts_oldest():
    index = SuffixIndex(max_tokens=1000)
    for s in range(100):  # 100 * 101 slots, ten times the bound; each sequence its own ids
        index.add(list(range(1000 * s, 1000 * s + 100)))
    assert index.num_tokens <= 1000
    assert index.propose([0, 1, 2], 3) == []  # the oldest sequences are gone
    assert index.propose([50_000, 50_001], 3) == []
    assert index.propose([99_010, 99_011], 3) == [99_012, 99_013, 99_014]


def test_overlong_sequence_keeps_its_end():
    index = SuffixIndex(max_tokens=50)
    index.add(list(range(200)))
    assert index.num_tokens <= 50
    assert index.propose([10, 11], 2) == []
    assert index.propose([190, 191], 2) == [192, 193]


def test_accepts_tensors_and_arrays():
    index = SuffixIndex(max_tokens=1000)
    index.add(torch.arange(10, 30))
    assert index.propose(torch.tensor([12, 13]), 2) == [14, 15]
    assert index.propose(np.array([12, 13]), 2) == [14, 15]


def test_suffix_index_throughput():
    """Printed, not asserted: propose latency on a synthetic replica history."""
    rng = np.random.default_rng(0)
    phrases = rng.integers(0, 32_000, size=(500, 20))
    index = SuffixIndex(max_tokens=200_000)
    t0 = time.perf_counter()
    for _ in range(1000):  # requests stitched from shared phrases, so chains are long
        index.add(phrases[rng.integers(0, 500, size=10)].ravel().tolist())
    t_add = time.perf_counter() - t0
    contexts = [phrases[rng.integers(0, 500, size=100)].ravel().tolist() for _ in range(200)]
    t0 = time.perf_counter()
    drafts = [index.propose(c, 8) for c in contexts]
    t_propose = time.perf_counter() - t0
    print(
        f"\nSuffixIndex: {index.num_tokens} tokens, add {t_add / 1000 * 1e3:.2f} ms/request, "
        f"propose {t_propose / len(contexts) * 1e6:.0f} us, "
        f"mean draft {np.mean([len(d) for d in drafts]):.1f}, {index.nbytes / index.num_tokens:.1f} B/token"
    )


# ---- TokenRecycling ------------------------------------------------------------------------


def _topk(rows: list[list[int]], top_k: int = 3) -> torch.Tensor:
    return torch.tensor([r + [0] * (top_k - len(r)) for r in rows])


def test_chain_follows_top1():
    tr = TokenRecycling(vocab_size=100)
    tr.observe([5, 6, 7], _topk([[6, 1], [7, 2], [5, 3]]))
    assert tr.propose([1, 5], 2) == [6, 7]
    assert tr.propose([7], 5) == [5, 6, 7, 5, 6]  # a cycle repeats, capped at k


def test_chain_stops_at_unrecorded_token():
    tr = TokenRecycling(vocab_size=100)
    tr.observe([5, 6], _topk([[6], [9]]))
    assert tr.propose([5], 8) == [6, 9]


def test_unknown_tokens_give_nothing():
    tr = TokenRecycling(vocab_size=100)
    assert tr.propose([5], 4) == []  # nothing observed, table not even allocated
    assert tr.nbytes == 0
    tr.observe([5], _topk([[6]]))
    assert tr.propose([42], 4) == []
    assert tr.propose([500], 4) == []  # out of vocab
    assert tr.propose([5], 0) == []
    assert tr.propose([], 4) == []


def test_overwrite_keeps_latest():
    tr = TokenRecycling(vocab_size=100)
    tr.observe([5], _topk([[6]]))
    tr.observe([5], _topk([[9]]))
    assert tr.propose([5], 1) == [9]
    tr.observe([5, 8, 5], _topk([[10], [11], [12]]))  # repeated in one call: the last wins
    assert tr.propose([5], 1) == [12]


def test_top_k_columns_and_bounds():
    tr = TokenRecycling(vocab_size=50_000, top_k=4, max_tokens=3)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [2, 9, 9, 9, 9, 9], [3, 0, 0, 0, 0, 0]])
    tr.observe(torch.tensor([0, 1, 2]), ids)  # wider top-k than the table keeps
    assert tr._table.shape == (50_000, 4) and tr._table.dtype == np.int32
    assert tr._table[0].tolist() == [1, 2, 3, 4]
    assert tr.nbytes == 50_000 * 4 * 4
    assert tr.propose([0], 10) == [1, 2, 3]  # max_tokens caps the chain


def test_token_recycling_throughput():
    """Printed, not asserted."""
    rng = np.random.default_rng(0)
    tr = TokenRecycling(vocab_size=151_936)
    tokens = rng.integers(0, 151_936, size=4096)
    ids = torch.from_numpy(rng.integers(0, 151_936, size=(4096, 8)))
    t0 = time.perf_counter()
    tr.observe(tokens, ids)
    t_observe = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in tokens[:1000].tolist():
        tr.propose([t], 8)
    t_propose = (time.perf_counter() - t0) / 1000
    print(
        f"\nTokenRecycling: observe 4096 positions {t_observe * 1e3:.2f} ms, propose k=8 "
        f"{t_propose * 1e6:.1f} us, table {tr.nbytes / 2**20:.1f} MiB"
    )


# ---- behind the drafter interface ----------------------------------------------------------


class FixedSource:
    """A DraftSource that always proposes the same tokens (to see which source MLA picked)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, tokens, k):
        return self.tokens[:k]


def test_source_drafter_caps_at_k_and_proposes_one_hot():
    index = SuffixIndex(max_tokens=1000)
    index.add(list(range(100, 120)))
    rows = [Row("a", [1, 105, 106], k=3), Row("b", [7, 8], k=3), Row("c", [105, 106], k=0, temperature=0.8)]
    drafts = SourceDrafter(index).propose(rows)
    assert drafts.tokens == [[107, 108, 109], [], []] and drafts.q == [None, None, None]


def test_mla_takes_the_first_source_that_proposes():
    drafter = ModelDrafter(Runner(tiny_model(seed=1, num_hidden_layers=1)))
    drafter.share_sources({"suffix": FixedSource([11, 12, 13]), "recycle": FixedSource([21, 22])})
    context = [1, 2, 3, 4]  # prompt lookup finds nothing here
    row = Row("a", context, k=8, mla_sources=("pld", "suffix", "recycle"))
    assert drafter._mla_proposal(row, context, 2) == [11, 12]
    row.mla_sources = ("recycle", "suffix")
    assert drafter._mla_proposal(row, context, 5) == [21, 22]
    row.mla_sources = ("pld",)
    assert drafter._mla_proposal(row, [1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert drafter._mla_proposal(row, context, 5) == []
    assert drafter._mla_proposal(Row("b", context, k=8, mla=False, mla_sources=("suffix",)), context, 5) == []
    alone = ModelDrafter(Runner(tiny_model(seed=1, num_hidden_layers=1)))  # no shared sources: skipped
    assert alone._mla_proposal(Row("c", context, k=8, mla_sources=("suffix", "recycle")), context, 5) == []


def test_scorer_reports_the_targets_topk_per_position():
    scorer = ModelScorer(Runner(tiny_model(seed=0, initializer_range=0.2)), topk=5)
    rows = [Row("a", [5, 17, 42, 99], k=3), Row("b", [1, 2, 3], k=1)]
    verdict = scorer.verify(rows, Drafts([[4, 5, 6], [9]], [None, None]))
    assert verdict.topk.shape == (2, 4, 5) and verdict.topk.dtype == torch.long
    assert torch.equal(verdict.topk[0, :, 0], verdict.y[0]) and verdict.topk[1, 0, 0] == verdict.y[1, 0]
    assert all(len(set(t.tolist())) == 5 for t in verdict.topk.reshape(-1, 5))  # distinct ids, best first
    assert ModelScorer(Runner(tiny_model(seed=0)), topk=0).verify(rows, Drafts([[4], [9]], [None, None])).topk is None


def test_free_sources_cost_like_prompt_lookup_in_the_policy():
    cost = RoundCostModel()
    for kind in (SUFFIX, RECYCLE):
        rows = [RowInfo("a", 8, acceptance=0.7), RowInfo("b", 8, source=kind, acceptance=0.5)]
        pld = [RowInfo("a", 8, acceptance=0.7), RowInfo("b", 8, source=PLD, acceptance=0.5)]
        assert plan(rows, cost).ks == plan(pld, cost).ks
    with pytest.raises(ValueError, match="^source:"):
        RowInfo("a", 8, source="lookup")


def test_snapshot_and_restore_forget_later_learning():
    index = SuffixIndex(max_tokens=100)
    index.add([1, 2, 3, 4])
    saved = index.snapshot()
    for s in range(20):  # evicts [1, 2, 3, 4] and fills the ring
        index.add([50 + s, 60, 61, 62])
    assert index.propose([1, 2], 2) == []
    index.restore(saved)
    assert index.propose([1, 2], 2) == [3, 4] and index.propose([60, 61], 1) == []
    assert index.num_sequences == 1 and index.num_tokens == 4
    index.add([7, 8, 9])  # the restored arrays are its own, not the snapshot's
    assert index.propose([7, 8], 1) == [9] and saved["_tokens"] is not index._tokens
    empty = SuffixIndex(max_tokens=100)
    blank = empty.snapshot()
    empty.add([1, 2, 3])
    empty.restore(blank)
    assert empty.propose([1, 2], 1) == [] and empty.nbytes == 0

    tr = TokenRecycling(vocab_size=100)
    assert tr.snapshot() is None
    tr.observe([5], _topk([[6]]))
    saved = tr.snapshot()
    tr.observe([5], _topk([[9]]))
    tr.restore(saved)
    assert tr.propose([5], 1) == [6]
