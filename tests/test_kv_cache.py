"""The paged KV cache on tiny random models (fp32): every logit the Runner gives through it equals
the transformers model's own full forward, whatever the blocks went through (ragged batches,
rollback, block boundaries, release and reuse, growth, eviction); blocks go back to the pool; a
write past the budget raises KVCacheFull and leaves everything as it was."""

import pytest
import torch

from fly_serve.loading.tiny import tiny_model
from fly_serve.runtime.kv_cache import KVCache, KVCacheFull, SeqRecord, budget_from_device, cdiv
from fly_serve.runtime.runner import Runner


def record_of(cache: KVCache, key: str) -> SeqRecord:
    """What the cache holds of key's sequence (an empty record for a key it does not hold)."""
    return cache.seqs[cache.seq_of[key]] if key in cache.seq_of else SeqRecord()


MODEL = tiny_model(seed=0)
BS = 4  # small blocks, so that a few tokens cross block boundaries


def seq(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def reference(tokens: list[int]) -> torch.Tensor:
    return MODEL(torch.tensor([tokens])).logits[0]


def check(runner: Runner, keys: list[str], seqs: list[list[int]]) -> list[int]:
    """Feed the rows in one batch and compare each fed position's logits with the reference."""
    logits, fed = runner.feed(keys, seqs)
    for b, (s, n) in enumerate(zip(seqs, fed)):
        assert torch.allclose(logits[b, :n], reference(s)[len(s) - n :], atol=1e-5), keys[b]
    for key, s in zip(keys, seqs):
        assert len(record_of(runner.cache, key).tokens) == len(s)
        assert len(record_of(runner.cache, key).blocks) == cdiv(len(s), BS)
    return fed


def runner(**kw) -> Runner:
    return Runner(MODEL, **{"n_slots": 4, "block_size": BS, **kw})


def test_ragged_rows_match_transformers_across_block_boundaries():
    r = runner()
    keys, seqs = ["a", "b", "c", "d"], [seq(n, n) for n in (3, 9, 17, 30)]
    assert check(r, keys, [s[:n] for s, n in zip(seqs, (2, 4, 5, 13))]) == [2, 4, 5, 13]  # a ragged prefill
    assert check(r, keys, seqs) == [1, 5, 12, 17]  # extend from the cache, crossing boundaries
    for step in range(1, 7):  # decode-like steps, several rows at once
        seqs = [s + seq(step % 3 + 1, 100 * b + step) for b, s in enumerate(seqs)]
        check(r, keys, seqs)


def test_rollback_frees_blocks_and_recomputes_only_the_difference():
    r = runner(budget_tokens=64)  # 16 blocks, allocated now
    s = seq(30, 1)
    check(r, ["a"], [s[:10] + [1, 2, 3, 4, 5, 6, 7, 8]])  # 18 tokens: 5 blocks
    assert r.cache.free_blocks() == 16 - 5
    assert check(r, ["a"], [s[:7]]) == [1]  # rollback past two boundaries, the last token re-fed
    assert r.cache.free_blocks() == 16 - 2
    assert check(r, ["a"], [s[:9] + [9, 9]]) == [4]  # a different continuation
    assert check(r, ["a"], [s]) == [21]
    assert r.cache.free_blocks() == 16 - cdiv(30, BS)


def test_release_returns_blocks_and_another_key_reuses_them():
    r = runner(budget_tokens=64)
    check(r, ["a", "b"], [seq(21, 2), seq(11, 3)])
    held = r.cache.free_blocks()
    r.release(["a"])
    assert r.cache.free_blocks() == held + cdiv(21, BS) and len(record_of(r.cache, "a").tokens) == 0
    check(r, ["c"], [seq(25, 4)])  # takes a's blocks
    check(r, ["b", "c"], [seq(11, 3) + [5], seq(25, 4) + [6, 7]])
    r.release(["b", "c"])
    assert r.cache.free_blocks() == 16
    assert check(r, ["a"], [seq(21, 2)]) == [21]  # released means forgotten


def test_padding_never_writes_into_another_keys_blocks():
    r = runner(budget_tokens=64)
    x, y, z = seq(8, 5), seq(10, 6), seq(13, 7)
    check(r, ["x"], [x])
    check(r, ["x"], [x[:3]])  # x keeps one block; its second goes back ...
    check(r, ["y"], [y])  # ... and y takes it
    check(r, ["x", "z"], [x[:4], z])  # x feeds 1 token, padded to 13 positions past its one block
    check(r, ["y"], [y + [1]])  # y's keys survived x's padding


def test_batches_with_scattered_blocks_use_the_gather_path():
    r = runner()
    a, b = seq(40, 8), seq(40, 9)
    for n in range(4, 41, 4):  # interleaved growth: a's blocks are not consecutive
        check(r, ["a", "b"], [a[:n], b[:n]])
    seq_a = r.cache.seq_of["a"]
    assert r.cache.run_start(seq_a, cdiv(41, BS)) is None
    check(r, ["a"], [a + [3]])  # one row, gathered
    r.release(["a", "b"])
    check(r, ["c"], [a])
    assert r.cache.run_start(r.cache.seq_of["c"], cdiv(40, BS)) is not None  # one row, a slice
    check(r, ["c"], [a + [3]])


def test_write_past_the_budget_raises_and_changes_nothing():
    r = runner(budget_tokens=8 * BS)  # 8 blocks
    a, b = seq(12, 10), seq(8, 11)
    check(r, ["a", "b"], [a, b])  # 3 + 2 blocks
    free = r.cache.free_blocks()
    with pytest.raises(KVCacheFull) as e:
        r.feed(["c"], [seq(20, 12)], protect=["a", "b"])  # 5 blocks, 3 free, nothing idle
    assert (e.value.key, e.value.needed, e.value.free) == ("c", 5, 3)
    with pytest.raises(KVCacheFull) as e:  # a's rollback frees a block, still short; a is not rolled back
        r.feed(["a", "c"], [a[:5], seq(24, 12)], protect=["b"])
    assert e.value.key == "c"
    assert r.cache.free_blocks() == free and "c" not in r.cache.seq_of
    assert len(record_of(r.cache, "a").tokens) == 12 and len(record_of(r.cache, "b").tokens) == 8
    assert check(r, ["a", "b"], [a + [1], b + [2]]) == [1, 1]  # their keys and values are intact


def test_idle_keys_are_evicted_least_recently_used_first():
    r = runner(budget_tokens=8 * BS)
    a, b = seq(12, 13), seq(8, 14)
    check(r, ["a"], [a])
    check(r, ["b"], [b])  # a is now the least recently used
    check(r, ["c"], [seq(20, 15)])  # needs 5 blocks, 3 free: a goes, b stays
    assert len(record_of(r.cache, "a").tokens) == 0 and len(record_of(r.cache, "b").tokens) == 8
    check(r, ["b"], [b + [4]])
    assert check(r, ["a"], [a]) == [12]  # evicted means recomputed, still exact (c goes now)


def test_max_seqs_drops_the_least_recently_used_idle_key():
    r = runner(n_slots=2)
    check(r, ["a"], [seq(5, 16)])
    check(r, ["b"], [seq(5, 17)])
    check(r, ["c"], [seq(5, 18)])
    assert list(r.cache.seq_of) == ["b", "c"]
    check(r, ["a", "b", "c"], [seq(5, 16), seq(6, 17), seq(5, 18)])  # more keys than max_seqs in one call is fine


def test_default_pool_starts_small_and_grows_up_to_the_budget():
    r = Runner(MODEL, n_slots=2, capacity=4, block_size=BS)  # capacity: the starting size, as before
    assert r.cache.pool.allocated == cdiv(2 * 4, BS) and r.cache.capacity_tokens == 2 * 4096
    s = seq(60, 19)
    check(r, ["a"], [s[:10] + [1, 2, 3]])
    check(r, ["a"], [s])
    assert r.cache.pool.allocated >= cdiv(60, BS) and r.cache.free_blocks() == r.cache.n_blocks - cdiv(60, BS)


def test_budgets_give_the_expected_number_of_blocks():
    cache = KVCache(2, 2, 16, torch.float32, budget_tokens=100, block_size=16)
    assert cache.n_blocks == 6 and cache.capacity_tokens == 96 and cache.free_tokens() == 96
    assert cache.plan([], []) == [] and cache.free_tokens() == 96  # no rows: nothing to change
    assert cache.block_bytes == 2 * 2 * 16 * 2 * 16 * 4  # keys and values x layers x tokens x heads x dim x 4 bytes
    cache = KVCache(2, 2, 16, torch.bfloat16, budget_bytes=11 * 4096 + 100, block_size=16)
    assert cache.n_blocks == 10  # one block of the budget is scratch
    assert sum(t.numel() * t.element_size() for t in cache.k + cache.v) == 11 * cache.block_bytes
    lazy = KVCache(2, 2, 16, torch.float32, budget_tokens=1000, initial_tokens=20)
    assert lazy.pool.allocated == 2 and lazy.free_blocks() == lazy.n_blocks == 62
    for bad in (dict(), dict(budget_tokens=16, budget_bytes=1 << 20), dict(budget_tokens=15)):
        with pytest.raises(ValueError):
            KVCache(2, 2, 16, torch.float32, **bad)
    budget = budget_from_device(0.25, "cpu")
    assert 0 < budget and Runner(MODEL, budget_bytes=budget // 1000).cache.n_blocks > 0


def test_prefill_groups_join_similar_lags_within_the_caps():
    from fly_serve.runtime.runner import prefill_groups

    assert prefill_groups([]) == []
    assert prefill_groups([50, 44, 47, 41]) == [[0, 2, 1, 3]]  # longest first; 200 padded, 18 padding
    # 400 and 50: padding 350 of 800 is too much, so the short rows group apart
    assert prefill_groups([50, 400, 45]) == [[1], [0, 2]]
    # the padded size cap: 3 x 400 > 1024, so the third row opens a group of its own
    assert prefill_groups([400, 400, 400], max_tokens=1024) == [[0, 1], [2]]
    assert prefill_groups([2000, 30]) == [[0], [1]]  # a row above the cap alone, as before
    # attention: 3 rows x 100 padded x 300 keys = 90,000 pairs; a cap of 60,000 splits them 2 + 1
    assert prefill_groups([100, 100, 100], [300, 200, 100]) == [[0, 1, 2]]
    assert prefill_groups([100, 100, 100], [300, 200, 100], max_scores=60_000) == [[0, 1], [2]]
    assert prefill_groups([7, 90, 33, 88, 31, 6, 89]) == [[1, 6, 3, 2], [4], [0, 5]]  # 33 in: 60 of 360 padding


def test_catch_up_prefills_lagging_rows_together_and_the_logits_match():
    r = runner()
    keys, seqs = ["a", "b", "c", "d"], [seq(n, 10 + n) for n in (20, 22, 19, 3)]
    feeds = []
    feed = r.feed
    r.feed = lambda k, t, **kw: feeds.append(list(k)) or feed(k, t, **kw)
    r.catch_up(keys, seqs)
    assert feeds == [["b", "a", "c"], ["d"]]  # "d" lags 3, over max_lag 1: padded to 22, apart
    r.feed = feed
    for key, s in zip(keys, seqs):
        assert len(record_of(r.cache, key).tokens) == len(s) - 1  # the last token is the round's own
    check(r, keys, [s + seq(2, 7) for s in seqs])  # every row's next logits equal the full forward's


def test_an_update_that_fails_midway_changes_nothing(monkeypatch):
    """The memory an update needs (a larger pool, a wider block table) is taken before its first
    change: a pool that fails to grow after one layer's tensor grew (out of memory) leaves every
    sequence, block count and table entry as it was, and the same update then succeeds."""
    r = Runner(MODEL, n_slots=4, capacity=4, block_size=BS, prefix_cache=True)
    a, b = seq(30, 21), seq(12, 22)
    check(r, ["a", "b"], [a, b])
    c = r.cache

    def state():
        rows = {
            k: (list(c.seqs[s].tokens), list(c.seqs[s].blocks), list(c.seqs[s].hashes)) for k, s in c.seq_of.items()
        }
        return rows, sorted(c.pool.free), list(c.pool.ref), c.pool.allocated, dict(c.pool.registry), c.table.clone()

    before = state()
    zeros, calls = torch.zeros, []

    def fails_on_the_second_layer(*args, **kw):
        calls.append(args)
        if len(calls) == 2:
            raise MemoryError("no memory for the pool's next layer")
        return zeros(*args, **kw)

    monkeypatch.setattr(torch, "zeros", fails_on_the_second_layer)
    longer = a + seq(60, 23)  # more blocks than the pool has: it must grow
    with pytest.raises(MemoryError):
        c.plan(["a", "new"], [longer, seq(9, 24)])
    monkeypatch.setattr(torch, "zeros", zeros)
    after = state()
    assert after[:5] == before[:5] and torch.equal(after[5], before[5])
    check(r, ["a", "new"], [longer, seq(9, 24)])  # the same rows now: every logit as the model's own
    check(r, ["b"], [b + [7]])
    assert len(record_of(r.cache, "a").tokens) == len(longer) and len(record_of(r.cache, "b").tokens) == len(b) + 1
