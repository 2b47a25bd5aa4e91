"""The llama.cpp runtime (fly_serve/runtime/llama_runner.py) on a tiny random model written as GGUF: its
logits against the torch model's, the KV cache's content rule (rollback, catch-up, prefix
sharing, eviction, a full cache), and the engine on top of it (spd and strict FLy give the
runtime's own plain greedy text)."""

import subprocess
import sys

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.loading.loading import load_model, resolve_runtime
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer
from fly_serve.loading.weights import DEFAULT_TARGET
from fly_serve.runtime.kv_cache import KVCacheFull
from fly_serve.runtime.llama_runner import LlamaRunner

TOL = 2e-3  # llama.cpp keeps K and V in f16; the torch model computes them in fp32


@pytest.fixture(scope="module")
def gguf():
    return load_model("tiny:0", runtime="llama.cpp")


def runner(gguf, **kw) -> LlamaRunner:
    return LlamaRunner(gguf, **{"n_slots": 4, "budget_tokens": 1024, "threads": 1, **kw})


def held(r: LlamaRunner, key: str) -> int:
    """Tokens the llama.cpp cache holds for key (0 for a key it does not hold)."""
    seq = r.cache.rows.get(key)
    return 0 if seq is None else len(seq.tokens)


def torch_logits(tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return tiny_model(0)(torch.tensor([tokens])).logits[0]


SEQ = [5, 77, 100, 12, 40, 41, 42, 200, 3, 9, 250, 17]


def test_logits_at_every_fed_position_match_the_torch_model(gguf):
    r = runner(gguf)
    logits, fed = r.feed(["a"], [SEQ])
    assert fed == [len(SEQ)] and logits.shape == (1, len(SEQ), gguf.n_vocab)
    assert torch.allclose(logits[0], torch_logits(SEQ), atol=TOL)


def test_rows_of_different_lengths_in_one_forward_each_get_their_own_logits(gguf):
    r = runner(gguf)
    rows = [SEQ, SEQ[:5], [7, 8, 9, 10, 11, 12, 13]]
    logits, fed = r.feed(["a", "b", "c"], rows)
    assert fed == [12, 5, 7] and logits.shape[1] == 12
    for b, toks in enumerate(rows):
        assert torch.allclose(logits[b, : len(toks)], torch_logits(toks), atol=TOL)
        assert (logits[b, len(toks) :] == 0).all()  # right padding holds zeros


def test_tail_gives_each_rows_last_positions_left_aligned_and_feeds_them_again(gguf):
    r = runner(gguf)
    r.feed(["a"], [SEQ])  # all cached
    logits, fed = r.feed(["a"], [SEQ], tail=[3])
    assert fed == [3] and logits.shape == (1, 3, gguf.n_vocab)
    assert torch.allclose(logits[0], torch_logits(SEQ)[-3:], atol=TOL)


def test_rejected_drafts_roll_back_and_the_row_continues_as_if_never_fed(gguf):
    r = runner(gguf)
    r.feed(["a"], [SEQ + [1, 2, 3]], tail=[4])  # a verify of three drafts
    assert r.cache.valid("a", SEQ + [1, 2, 3]) == len(SEQ) + 3
    other = SEQ + [1, 99]  # the second draft was rejected: 99 recovered
    assert r.cache.valid("a", other) == len(SEQ) + 1
    logits, fed = r.feed(["a"], [other + [4]], tail=[2])
    assert fed == [2]
    assert held(r, "a") == len(other) + 1
    assert torch.allclose(logits[0], torch_logits(other + [4])[-2:], atol=TOL)


def test_catch_up_prefills_only_rows_that_lag(gguf):
    r = runner(gguf)
    r.feed(["a"], [SEQ[:11]])
    r.catch_up(["a", "b", "c"], [SEQ, SEQ[:6], SEQ[::-1]])
    assert held(r, "a") == 11  # a lag of one rides in the round's own forward
    assert held(r, "b") == 5 and held(r, "c") == len(SEQ) - 1  # all but the last token, whose logits the round wants


def test_a_lone_newcomer_rides_in_the_rounds_forward_its_first_token_one_decode(gguf):
    """One row lagging (a request arriving alone): the catch-up leaves its prompt to the round's
    own forward, which feeds all of it in one decode and reads the first token's logits from the
    prompt's last position (as llama-server does), beside the other rows' tokens."""
    r = runner(gguf)
    r.feed(["a"], [SEQ[:11]])
    r.catch_up(["a", "b"], [SEQ, SEQ[::-1]])
    assert held(r, "b") == 0
    decodes = []
    decode = r._decode_chunk
    r._decode_chunk = lambda ids, *a: (decodes.append(len(ids)), decode(ids, *a))[1]
    logits, fed = r.feed(["a", "b"], [SEQ, SEQ[::-1]], tail=[1, 1])
    assert decodes == [1 + len(SEQ)] and fed == [1, len(SEQ)]
    assert torch.allclose(logits[0, 0], torch_logits(SEQ)[-1], atol=TOL)
    assert torch.allclose(logits[1, 0], torch_logits(SEQ[::-1])[-1], atol=TOL)


def test_a_prompt_longer_than_one_batch_is_fed_in_order_in_several_decodes(gguf):
    r = runner(gguf, batch_tokens=5)
    rows = [SEQ, SEQ[::-1]]
    logits, _ = r.feed(["a", "b"], rows)
    for b, toks in enumerate(rows):
        assert torch.allclose(logits[b, : len(toks)], torch_logits(toks), atol=TOL)


def test_a_new_row_adopts_the_prefix_a_released_row_shares_with_it(gguf):
    prompt = list(range(20, 60))  # longer than llama_runner.MIN_SHARED
    r = runner(gguf, prefix_cache=True)
    r.feed(["a"], [prompt + [1, 2]])
    r.release(["a"])
    logits, fed = r.feed(["b"], [prompt + [7, 8]])
    assert fed == [2] and r.cache.take_hits(["b"]) == [len(prompt)]
    assert torch.allclose(logits[0, :2], torch_logits(prompt + [7, 8])[-2:], atol=TOL)
    plain = runner(gguf, prefix_cache=False)
    plain.feed(["a"], [prompt + [1, 2]])
    plain.release(["a"])
    _, fed = plain.feed(["b"], [prompt + [7, 8]])
    assert fed == [len(prompt) + 2] and plain.cache.take_hits(["b"]) == [0]


def seq_cells(r: LlamaRunner, seq: int) -> int:
    """Cells llama.cpp holds for a sequence id (its positions are 0..n-1 here)."""
    from fly_serve.runtime.llama_runner import lib

    return lib().llama_memory_seq_pos_max(r.cache.mem, seq) + 1


def test_a_donor_is_kept_out_of_the_cache_and_restored_for_the_prefix_it_shares(gguf):
    """A released row leaves llama.cpp's cache (every query scans every cell: kept cells slow every
    token) and lives on as host bytes; a row sharing part of it gets those cells back, the rest
    cut, and its logits are the model's."""
    prompt = list(range(20, 60))
    r = runner(gguf, prefix_cache=True)
    r.feed(["a"], [prompt + list(range(100, 130))])
    seq = r.cache.rows["a"].id
    r.release(["a"])
    assert seq_cells(r, seq) == 0 and seq in r.cache.free_ids
    assert len(r.cache.donors) == 1 and r.cache.donor_tokens == len(prompt) + 30
    logits, fed = r.feed(["b"], [prompt + [7, 8]])
    assert fed == [2] and r.cache.take_hits(["b"]) == [len(prompt)]
    assert seq_cells(r, r.cache.rows["b"].id) == len(prompt) + 2  # the donor's tail was cut
    assert torch.allclose(logits[0, :2], torch_logits(prompt + [7, 8])[-2:], atol=TOL)
    r.release(["b"])
    logits, fed = r.feed(["c"], [prompt + list(range(100, 130)) + [9]], tail=[1])  # all of a, a turn later
    assert fed == [1] and r.cache.take_hits(["c"]) == [len(prompt) + 30]
    assert torch.allclose(logits[0, 0], torch_logits(prompt + list(range(100, 130)) + [9])[-1], atol=TOL)


def test_a_prompt_cached_whole_costs_its_next_request_one_token(gguf):
    """The same prompt again (a retry, a second user, a bench's bursts): the round's forward adopts
    all but the last token from the donor and feeds that one (the catch-up leaves a lone row to it
    and calls nothing)."""
    prompt = list(range(20, 60))
    r = runner(gguf, prefix_cache=True)
    r.catch_up(["a"], [prompt])
    r.feed(["a"], [prompt], tail=[1])
    r.release(["a"])
    decodes = []
    decode = r._decode_chunk
    r._decode_chunk = lambda ids, *a: (decodes.append(len(ids)), decode(ids, *a))[1]
    r.catch_up(["b"], [prompt])
    assert decodes == [] and held(r, "b") == 0
    logits, fed = r.feed(["b"], [prompt], tail=[1])
    assert decodes == [1] and fed == [1] and r.cache.take_hits(["b"]) == [len(prompt) - 1]
    assert torch.allclose(logits[0, 0], torch_logits(prompt)[-1], atol=TOL)


def firsts(r: LlamaRunner) -> list[int]:
    """Each donor's first token, least recently used first."""
    return [d.tokens[0] for d in r.cache.donors.values()]


def test_donors_are_bounded_extended_ones_dropped_and_one_without_room_is_a_prefill(gguf):
    r = runner(gguf, prefix_cache=True, n_slots=2, budget_tokens=256)
    for i in range(2):
        r.feed([f"d{i}"], [[i + 1] * 20 + list(range(30, 60))])
        r.release([f"d{i}"])
    r.feed(["u"], [[1] * 20 + list(range(30, 50)) + [9]])  # reuses d0 in part: d0 is used last
    assert r.cache.take_hits(["u"]) == [40] and firsts(r) == [2, 1]
    r.feed(["d2"], [[3] * 20 + list(range(30, 60))])
    r.release(["d2"])  # n_slots donors at most: the least recently used (d1) goes
    assert firsts(r) == [1, 3]
    wide = runner(gguf, prefix_cache=True, n_slots=4, budget_tokens=256)
    wide.feed(["a"], [[1] * 50])
    wide.release(["a"])
    wide.feed(["long"], [list(range(230))])
    wide.release(["long"])  # 50 + 230 tokens: more than the cache holds, so a goes (2 donors of 4)
    assert firsts(wide) == [0] and wide.cache.donor_tokens == 230
    wide.feed(["turn2"], [list(range(240))])
    wide.release(["turn2"])  # extends long: long is dropped, not kept beside it
    assert [len(d.tokens) for d in wide.cache.donors.values()] == [240]
    wide.feed(["short"], [list(range(100))])
    wide.release(["short"])  # turn2 holds all of it: nothing is copied
    assert [len(d.tokens) for d in wide.cache.donors.values()] == [240]
    wide.feed(["held"], [list(range(100, 200))])  # 156 cells left: turn2's 240 cannot come back
    logits, fed = wide.feed(["x"], [list(range(40)) + [7]], protect=["held"])
    assert fed == [41] and wide.cache.take_hits(["x"]) == [0] and held(wide, "held") == 100
    assert torch.allclose(logits[0, -1], torch_logits(list(range(40)) + [7])[-1], atol=TOL)


def test_two_rows_share_a_prefix_and_each_rolls_back_alone(gguf):
    prompt = list(range(30, 60))
    r = runner(gguf, prefix_cache=True)
    r.feed(["a"], [prompt + [1]])
    r.feed(["b"], [prompt + [2]])  # adopts the prompt from a
    r.feed(["a"], [prompt[:10] + [5, 6]])  # a drops most of the shared cells
    logits, fed = r.feed(["b"], [prompt + [2, 3]], tail=[1])
    assert fed == [1]
    assert torch.allclose(logits[0, 0], torch_logits(prompt + [2, 3])[-1], atol=TOL)


def test_rows_past_n_slots_are_held_while_cells_last_and_an_eviction_is_counted(gguf):
    """Sequence ids are llama.cpp's maximum, not max_batch: rows from more callers than n_slots
    (a drafter replica drafting for several ingress units) keep their cells. When the cells run
    out, an idle row gives its own (counted: it prefills again), a busy one never."""
    r = runner(gguf, n_slots=2)
    rows = [f"row{i}" for i in range(40)]
    for key in rows:
        r.feed([key], [SEQ])
    assert all(held(r, key) == len(SEQ) for key in rows) and r.cache.evicted == 0
    small = runner(gguf, n_slots=2, budget_tokens=256)
    small.feed(["a"], [list(range(100))])
    small.feed(["b"], [list(range(100, 200))])
    small.feed(["c"], [list(range(60))], protect=["b"])  # no room: a, idle and not protected, goes
    assert held(small, "a") == 0 and held(small, "b") == 100 and held(small, "c") == 60
    assert small.cache.evicted == 1
    with pytest.raises(KVCacheFull):
        small.feed(["d"], [list(range(200))], protect=["b", "c"])
    assert held(small, "b") == 100 and held(small, "c") == 60


def test_the_health_probe_computes_and_touches_no_row(gguf):
    """One token through the model in the id kept for the probe: its logits are the model's,
    and every row keeps its cells, id and place (nothing evicted, even with every cell taken)."""
    r = runner(gguf, n_slots=1, budget_tokens=256)
    r.feed(["a"], [list(range(100))])
    before = {k: (s.id, list(s.tokens)) for k, s in r.cache.rows.items()}
    logits = r.probe()
    assert torch.allclose(logits[0], torch_logits([0])[-1], atol=TOL)
    assert {k: (s.id, list(s.tokens)) for k, s in r.cache.rows.items()} == before and r.cache.evicted == 0
    r.feed(["b"], [list(range(100, 255))], protect=["a"])  # every cell but one taken
    for _ in range(3):
        r.probe()
    assert held(r, "a") == 100 and held(r, "b") == 155 and r.cache.evicted == 0
    logits, _ = r.feed(["a"], [list(range(101))], tail=[1])  # a continues from its own cells
    assert torch.allclose(logits[0, 0], torch_logits(list(range(101)))[-1], atol=TOL)


def test_a_full_cache_raises_and_leaves_each_row_its_valid_prefix(gguf):
    r = runner(gguf, n_slots=2, budget_tokens=256)
    r.feed(["a"], [list(range(200))])
    with pytest.raises(KVCacheFull):
        r.feed(["a", "b"], [list(range(200)), list(range(100, 220))], protect=["a"])
    assert held(r, "a") == 199  # its last token is always fed again
    assert held(r, "b") == 0
    logits, _ = r.feed(["a"], [list(range(201))], tail=[1])  # and it still continues correctly
    assert torch.allclose(logits[0, 0], torch_logits(list(range(201)))[-1], atol=TOL)


@pytest.fixture(scope="module")
def engine():
    return build_engine(
        "tiny:0", "tiny:1", runtime="llama.cpp", max_batch=4, max_model_len=512, progress=lambda _: None
    )


PROMPTS = ["def fib(n):", "hello world, this is", "import numpy as np\n", "SELECT *"]


def test_the_engine_runs_both_models_on_llama_cpp(engine):
    assert isinstance(engine.scorer.runner, LlamaRunner)
    assert isinstance(engine.drafters["model"].runner, LlamaRunner)


@pytest.mark.parametrize("mode", ["spd", "fly", "pld", "suffix", "recycle"])
def test_greedy_speculation_gives_the_runtimes_own_plain_text(engine, mode):
    params = {"max_tokens": 48, "temperature": 0, "k": 5}
    ar = engine.generate(PROMPTS, {**params, "mode": "ar"})
    # strict FLy (theta 1): every mismatch rejected, so the text is the target's
    spec = engine.generate(PROMPTS, {**params, "mode": mode, "theta": 1.0})
    assert [r.generated for r in spec] == [r.generated for r in ar]
    assert sum(r.stats.emitted for r in spec) == sum(r.stats.emitted for r in ar)


def test_sampling_with_a_seed_repeats_on_llama_cpp(engine):
    params = {"mode": "spd", "max_tokens": 32, "temperature": 1.0, "seed": 7, "k": 4}
    first, second = (engine.generate(PROMPTS[:2], params) for _ in range(2))
    assert [r.generated for r in first] == [r.generated for r in second]


def test_auto_runs_gguf_models_on_llama_cpp_on_a_cpu_and_the_rest_on_torch():
    assert resolve_runtime("auto", DEFAULT_TARGET) == "llama.cpp"
    assert resolve_runtime("auto", "tiny:0") == "torch"
    assert resolve_runtime("auto", DEFAULT_TARGET, world=2) == "torch"
    assert resolve_runtime("auto", tiny_model(0)) == "torch"  # an already loaded model
    assert resolve_runtime("llama.cpp", "tiny:0") == "llama.cpp"
    with pytest.raises(ValueError, match="tensor parallelism"):
        resolve_runtime("llama.cpp", DEFAULT_TARGET, world=2)
    with pytest.raises(ValueError, match="runtime: must be one of"):
        resolve_runtime("vllm", DEFAULT_TARGET)


def test_without_the_native_part_auto_says_why_and_runs_torch_and_llama_cpp_fails_naming_it():
    """llama-cpp-python made unimportable in a child process (as a failed build leaves it)."""
    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "from fly_serve.loading.loading import resolve_runtime\n"
        "from fly_serve.loading.weights import DEFAULT_TARGET\n"
        "print('auto ->', resolve_runtime('auto', DEFAULT_TARGET))\n"
        "resolve_runtime('llama.cpp', DEFAULT_TARGET)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "auto -> torch" in out.stdout and "runtime auto: torch, since" in out.stdout
    assert "LlamaCppMissing" in out.stderr and "llama-cpp-python" in out.stderr and "cmake" in out.stderr


def test_the_tiny_gguf_uses_the_tiny_tokenizers_ids(gguf):
    assert gguf.n_vocab == len(tiny_tokenizer())


def test_a_precision_asked_for_loads_torch_under_auto_and_is_refused_on_llama_cpp():
    """llama.cpp has only the GGUF file's quantization: an explicit dtype or drafter_precision is
    applied on torch (runtime auto, saying so) or refused naming the knob (runtime llama.cpp)."""
    notes = []
    assert resolve_runtime("auto", DEFAULT_TARGET, progress=notes.append, precision="fp32", knob="dtype") == "torch"
    assert "dtype fp32" in notes[-1]
    assert resolve_runtime("auto", DEFAULT_TARGET, precision="auto") == "llama.cpp"
    with pytest.raises(ValueError, match=r"^dtype: runtime llama.cpp runs a GGUF file at its own quantization"):
        resolve_runtime("llama.cpp", DEFAULT_TARGET, precision="fp32", knob="dtype")
    with pytest.raises(ValueError, match=r"^drafter_precision: runtime llama.cpp .* drafter_precision int8"):
        build_engine("tiny:0", "tiny:1", runtime="llama.cpp", drafter_precision="int8", max_batch=1)
    # the default ("auto") runs on llama.cpp as the file is
    assert isinstance(
        load_model("tiny:1", "auto", runtime="llama.cpp"), type(load_model("tiny:0", runtime="llama.cpp"))
    )
