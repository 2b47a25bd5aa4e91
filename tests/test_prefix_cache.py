"""The prefix cache (kv_cache.py, prefix_cache=True) on tiny random models, fp32: a row that adopts
another sequence's blocks gets the same logits as the transformers model's own forward; refcounts,
copy-on-write and eviction under a small budget; the engine's outputs equal the cache-less
outputs token for token in every mode, and its request stats count the hit tokens."""

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.loading.tiny import tiny_model
from fly_serve.runtime.kv_cache import KVCacheFull, block_hash
from fly_serve.runtime.runner import Runner

MODEL = tiny_model(seed=0)
BS = 4


def seq(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def reference(tokens: list[int]) -> torch.Tensor:
    return MODEL(torch.tensor([tokens])).logits[0]


def runner(**kw) -> Runner:
    return Runner(MODEL, **{"n_slots": 4, "block_size": BS, "prefix_cache": True, **kw})


def check(r: Runner, keys: list[str], seqs: list[list[int]]) -> list[int]:
    """Feed the rows in one batch; every fed position's logits equal the reference's."""
    logits, fed = r.feed(keys, seqs)
    for b, (s, n) in enumerate(zip(seqs, fed)):
        assert torch.allclose(logits[b, :n], reference(s)[len(s) - n :], atol=1e-5), keys[b]
    for key, s in zip(keys, seqs):
        assert r.cache.seqs[r.cache.seq_of[key]].tokens == s
    return fed


def blocks(r: Runner, key: str) -> list[int]:
    return r.cache.seqs[r.cache.seq_of[key]].blocks


def test_a_second_sequence_adopts_the_full_blocks_of_a_shared_prefix():
    r = runner(budget_tokens=64)
    p = seq(18, 1)  # 4 full blocks and 2 tokens
    check(r, ["a"], [p + seq(3, 2)])
    assert check(r, ["b"], [p + seq(5, 3)]) == [23 - 16]  # 4 blocks adopted, the rest fed
    assert blocks(r, "a")[:4] == blocks(r, "b")[:4] and blocks(r, "a")[4] != blocks(r, "b")[4]
    assert r.cache.take_hits(["a", "b"]) == [0, 16] and r.cache.take_hits(["b"]) == [0]
    assert [r.cache.pool.ref[b] for b in blocks(r, "b")] == [2, 2, 2, 2, 1, 1]


def test_the_block_of_the_last_token_is_never_adopted():
    r = runner(budget_tokens=64)
    p = seq(16, 4)  # exactly 4 blocks
    check(r, ["a"], [p])
    assert check(r, ["b"], [p]) == [4]  # 3 blocks adopted; the 4th is fed for the last token's logits
    assert blocks(r, "a")[:3] == blocks(r, "b")[:3] and blocks(r, "a")[3] != blocks(r, "b")[3]
    logits, fed = r.feed(["c"], [p + [7, 8]], tail=[6])  # a limit: logits from position 12 on
    assert fed == [6] and torch.allclose(logits[0], reference(p + [7, 8])[12:], atol=1e-5)


def test_a_shared_block_is_copied_before_a_write_into_it():
    r = runner(budget_tokens=64)
    p = seq(20, 5)
    check(r, ["a"], [p])
    check(r, ["b"], [p + [1]])  # shares a's 5 blocks
    shared = blocks(r, "a")[2]
    assert check(r, ["a"], [p[:10] + [9, 9, 9]]) == [3]  # rollback into block 2, shared with b
    assert blocks(r, "a")[2] != shared and r.cache.pool.ref[shared] == 1  # a copied it; b keeps it
    assert blocks(r, "a")[:2] == blocks(r, "b")[:2]
    check(r, ["b"], [p + [1, 2]])  # b's cache is untouched by a's write
    assert check(r, ["a"], [p[:10] + [9, 9, 9, 4]]) == [1]


def test_released_blocks_stay_cached_until_the_budget_needs_them():
    r = runner(budget_tokens=32)  # 8 blocks
    p = seq(17, 6)
    check(r, ["a"], [p])
    r.release(["a"])
    assert r.cache.free_blocks() == 8 and len(r.cache.pool.evictable) == 4  # full blocks stay, evictable
    assert check(r, ["b"], [p + [3]]) == [2]
    assert r.cache.take_hits(["b"]) == [16]
    r.release(["b"])
    check(r, ["c"], [seq(30, 7)])  # 8 blocks: every cached one is evicted for it
    assert (
        r.cache.pool.registry.keys() == {h for h in r.cache.seqs[r.cache.seq_of["c"]].hashes}
        and len(r.cache.pool.evictable) == 0
    )
    r.release(["c"])
    assert check(r, ["d"], [p + [3]]) == [18]  # p's blocks were evicted: all fed


def test_a_shared_block_is_never_evicted_while_in_use_and_full_changes_nothing():
    r = runner(budget_tokens=32, max_seqs=8)  # 8 blocks
    p = seq(16, 8)
    check(r, ["a"], [p + [1]])  # 5 blocks
    check(r, ["b"], [p + [2]])  # adopts 4, owns 1: 6 in use
    assert r.cache.free_blocks() == 2
    before = (
        {k: list(v) for k, v in zip(r.cache.seq_of, (q.blocks for q in r.cache.seqs))},
        dict(r.cache.pool.registry),
    )
    with pytest.raises(KVCacheFull):  # 3 fresh blocks, only 2 free, and a, b are protected
        r.feed(["c"], [seq(12, 9)], protect=["a", "b"])
    assert (
        {k: list(v) for k, v in zip(r.cache.seq_of, (q.blocks for q in r.cache.seqs))},
        dict(r.cache.pool.registry),
    ) == before
    check(r, ["c"], [seq(12, 9)])  # a is evicted (least recent): its shared blocks stay with b
    assert "a" not in r.cache.seq_of
    assert all(r.cache.pool.ref[b] == 1 for b in blocks(r, "b"))
    check(r, ["b"], [p + [2, 3]])


def test_two_rows_of_one_call_share_and_a_row_never_adopts_a_block_another_writes():
    r = runner(budget_tokens=128)
    p = seq(24, 10)
    check(r, ["a"], [p])
    # a rolls back into its own registered blocks while b, new, would adopt them
    fed = check(r, ["a", "b"], [p[:9] + [5, 5, 5], p + [6]])
    assert fed[0] == 3 and fed[1] < 25
    check(r, ["a", "b"], [p[:9] + [5, 5, 5, 1], p + [6, 7]])


def test_hashes_chain_the_whole_prefix():
    assert block_hash(b"", [1, 2]) != block_hash(block_hash(b"", [0, 0]), [1, 2])
    assert block_hash(b"", [1, 2]) == block_hash(b"", [1, 2])


def test_off_registers_nothing():
    r = runner(budget_tokens=64, prefix_cache=False)
    p = seq(18, 11)
    check(r, ["a"], [p])
    assert check(r, ["b"], [p + [1]]) == [19] and not r.cache.pool.registry


# ---- the engine: the same text with the cache as without it

PREFIX = seq(40, 12)
PROMPTS = [PREFIX + seq(n, 20 + n) for n in (3, 9, 1)] + [PREFIX[:21] + seq(5, 30), PREFIX + seq(3, 23)]


def engines():
    return [
        build_engine("tiny:0", "tiny:1", max_batch=4, max_model_len=256, prefix_cache=on, calibrate=False)
        for on in (False, True)
    ]


@pytest.mark.parametrize("mode", ["ar", "spd", "fly", "fly-sampled", "pld"])
def test_outputs_equal_the_cache_less_outputs_sequential_and_batched(mode):
    params = {"mode": mode, "k": 4, "theta": 0.3, "max_tokens": 12}
    if mode == "fly-sampled":
        params.update(mode="fly", temperature=0.8, seed=7)
    off, on = engines()
    texts = {}
    for name, engine in (("off", off), ("on", on)):
        seq_out = [engine.generate([p], params)[0] for p in PROMPTS]  # one after another: hits on the cache
        batch_out = engine.generate(PROMPTS, params)  # batched, after the first pass: hits too
        texts[name] = [r.generated for r in seq_out + batch_out]
        if name == "on":
            hits = [r.stats.prefix_hit_tokens for r in seq_out]
            assert hits[0] == 0 and all(h > 0 for h in hits[1:])
            assert all(r.stats.prefix_hit_tokens > 0 for r in batch_out)
            if mode not in ("ar", "pld"):  # the drafter has a prefix cache of its own
                assert sum(r.stats.draft_prefix_hit_tokens for r in seq_out + batch_out) > 0
            assert seq_out[1].stats.as_dict()["prefix_hit_tokens"] == 32  # the 40-token prefix: 2 blocks of 16
        else:
            assert all(r.stats.prefix_hit_tokens == 0 for r in seq_out + batch_out)
    assert texts["on"] == texts["off"]


def invariants(r: Runner) -> None:
    """Every block is exactly one of: held (ref = its holders), cached and idle, or free."""
    c = r.cache
    holders: dict[int, int] = {}
    for s in c.seq_of.values():
        assert len(c.seqs[s].hashes) == len(c.seqs[s].tokens) // c.block_size
        for b in c.seqs[s].blocks:
            holders[b] = holders.get(b, 0) + 1
    assert all(c.pool.ref[b] == n for b, n in holders.items())
    assert all(c.pool.ref[b] == 0 for b in range(1, c.pool.allocated + 1) if b not in holders)
    assert set(c.pool.evictable) <= set(c.pool.hash_of) and not set(c.pool.evictable) & set(holders)
    assert not set(c.pool.free) & (set(holders) | set(c.pool.evictable))
    assert len(c.pool.free) + len(c.pool.evictable) + len(holders) == c.pool.allocated
    assert all(c.pool.registry[h] == b for b, h in c.pool.hash_of.items()) and len(c.pool.registry) == len(
        c.pool.hash_of
    )


def test_random_traffic_keeps_every_invariant_and_every_logit():
    gen = torch.Generator().manual_seed(0)
    r = runner(budget_tokens=96, max_seqs=3)  # 24 blocks: evictions happen
    prefixes = [seq(n, 40 + n) for n in (9, 14, 21)]
    held: dict[str, list[int]] = {}

    def rand(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    for step in range(80):
        keys = sorted({f"k{rand(5)}" for _ in range(1 + rand(2))})  # one or two rows a call
        if rand(5) == 0:
            r.release(keys)
            for key in keys:
                held.pop(key, None)
            invariants(r)
            continue
        rows = []
        for key in keys:
            toks, op = held.get(key), rand(3)
            if op == 0 or toks is None:  # a new request on one of the prefixes
                p = prefixes[rand(3)]
                toks = p[: 4 + rand(len(p) - 3)] + seq(3, step)
            elif op == 1:  # a round: drafts appended
                toks = toks + seq(1 + rand(5), 1000 + step)
            else:  # a rollback (rejected drafts), then one new token
                toks = toks[: 1 + rand(len(toks))] + [step]
            rows.append(toks)
        try:
            check(r, keys, rows)
            held.update(zip(keys, rows))
        except KVCacheFull:
            pass
        held = {k: v for k, v in held.items() if k in r.cache.seq_of}
        invariants(r)
    assert r.cache.hit_tokens_total > 0


def test_newcomers_prefilled_together_still_share_their_common_prefix():
    r = runner(n_slots=8)
    p = seq(18, 5)  # a shared "system prompt": 4 full blocks and 2 tokens
    keys = ["a", "b", "c"]
    seqs = [p + seq(n, 20 + n) for n in (9, 8, 7)]
    feeds = []
    feed = r.feed
    r.feed = lambda k, t, **kw: feeds.append(list(k)) or feed(k, t, **kw)
    r.catch_up(keys, seqs)
    r.feed = feed
    # the longest first, alone, so that its blocks are in the registry; the others then together
    assert feeds == [["a"], ["b", "c"]]
    assert r.cache.take_hits(keys) == [0, 16, 16]
    assert blocks(r, "a")[:4] == blocks(r, "b")[:4] == blocks(r, "c")[:4]
    check(r, keys, [s + seq(2, 9) for s in seqs])  # every row's next logits equal the full forward's
