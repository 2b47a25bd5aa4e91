"""What a GPU host needs that the CPU can test: devices from Ray's assignment, precision per device,
each model's own KV budget (allocated at start where growth could fail late), BOS for raw
completions, Llama 3.1 rope scaling through the sharded loader, the TP warm-up, the capture rule."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from fly_serve.build import build_engine
from fly_serve.drafting.drafters import ModelDrafter
from fly_serve.engine.prompts import bos_ids, chat_prompt, completion_prompt, encode
from fly_serve.loading import loading
from fly_serve.loading.sharded_load import load_shard
from fly_serve.loading.tiny import TINY_VOCAB_SIZE, tiny_llama, tiny_model, tiny_tokenizer
from fly_serve.runtime.devices import device_for, local_device, tp_backend
from fly_serve.runtime.runner import Runner, grown_from
from fly_serve.runtime.tp import init_group

BOS = "<|begin_of_text|>"


# ---- devices: what Ray assigned, not what is visible
def test_no_assigned_gpu_runs_on_the_cpu_even_when_gpus_are_visible():
    assert device_for([], visible="0,1,2,3") == torch.device("cpu")
    assert tp_backend(device_for([])) == "gloo"  # two CPU ranks never both take NCCL on cuda:0


def test_an_assigned_gpu_is_the_actors_own():
    # Ray sets CUDA_VISIBLE_DEVICES to the assigned ids: GPU 3 is then the process's cuda:0.
    assert device_for([3], visible="3") == torch.device("cuda", 0)
    assert device_for(["5"], visible="4,5") == torch.device("cuda", 1)  # ray.get_gpu_ids() may give strings
    assert device_for([2], visible="") == torch.device("cuda", 0)
    assert tp_backend(device_for([1], visible="1")) == "nccl"


def test_tp_ranks_on_a_node_get_distinct_gpus():
    # Four ranks, one GPU each (Ray gives each actor its own CUDA_VISIBLE_DEVICES): no duplicates
    # in global ids, each rank's cuda:0 being a different physical GPU.
    devices = [device_for([g], visible=str(g)) for g in range(4)]
    assert devices == [torch.device("cuda", 0)] * 4  # each process's own view ...
    # ... and with every GPU left visible (a runtime that does not narrow it), the rank's own index.
    assert [device_for([g], visible="0,1,2,3").index for g in range(4)] == [0, 1, 2, 3]


def test_fly_device_forces_the_local_device(monkeypatch):
    monkeypatch.setenv("FLY_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert local_device() == torch.device("cpu")
    monkeypatch.delenv("FLY_DEVICE")
    assert local_device() == torch.device("cuda", 0)


# ---- precision per device
def test_int8_on_a_gpu_resolves_to_bf16_with_a_log_line():
    said = []
    assert loading.resolve_precision("int8", torch.device("cuda", 0), said.append) == "bf16"
    assert said and "bf16" in said[0]
    assert loading.resolve_precision("int8", "cpu", said.append) == "int8"  # the CPU keeps its int8 drafter
    assert loading.resolve_precision("auto", "cuda") == "bf16"


def test_int8_is_resolved_before_any_refusal(monkeypatch):
    # The old order refused int8 as soon as a GPU was visible, before even the tiny branch.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = loading.load_model("tiny:1", "int8", device="cpu")  # an actor Ray gave no GPU
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    with pytest.raises(ValueError, match="int8"):
        loading.load_model("tiny:1", "int8", rank=0, world=2, device="cpu")


# ---- KV budgets
def test_target_and_drafter_have_their_own_budgets():
    eng = build_engine(
        "tiny:0", "tiny:1", max_batch=2, target_kv_budget_tokens=512, drafter_kv_budget_tokens=128, progress=None
    )
    assert eng.scorer.kv_capacity_tokens == 512
    assert eng.drafters["model"].kv_capacity_tokens == 128
    both = build_engine("tiny:0", "tiny:1", max_batch=2, kv_budget_tokens=256, progress=None)
    assert both.scorer.kv_capacity_tokens == both.drafters["model"].kv_capacity_tokens == 256


def test_a_drafter_budget_that_cannot_be_allocated_fails_at_start():
    with pytest.raises(RuntimeError):  # an allocation of petabytes: refused now, not at some round
        ModelDrafter(Runner(tiny_model(1), n_slots=1, budget_tokens=10**15))


def test_a_gpu_pool_is_allocated_whole_at_start():
    assert grown_from(torch.device("cpu"), 256) == 256  # the CPU grows as needed
    assert grown_from(torch.device("cuda", 0), 256) is None  # a GPU takes its whole budget now
    runner = Runner(tiny_model(0), n_slots=2)
    assert runner.cache.pool.allocated < runner.cache.n_blocks  # on this CPU: grown later


# ---- BOS
def test_raw_completions_get_bos_where_the_tokenizer_adds_one():
    llama_like, qwen_like = tiny_tokenizer(bos=BOS), tiny_tokenizer()
    assert bos_ids(llama_like) == [TINY_VOCAB_SIZE] and bos_ids(qwen_like) == []
    assert completion_prompt(llama_like, "ab") == [TINY_VOCAB_SIZE, 97, 98]
    assert completion_prompt(qwen_like, "ab") == [97, 98]
    assert encode(llama_like, "ab") == [97, 98]  # a chat text renders its own BOS: none added
    assert chat_prompt(llama_like, "ab").count(TINY_VOCAB_SIZE) == 0  # the tiny template has none


def test_engine_adds_bos_to_a_raw_text_prompt():
    eng = build_engine(tiny_llama(0), None, tokenizer=tiny_tokenizer(bos=BOS), max_batch=1, progress=None)
    assert eng.admit("ab", dict(mode="ar", max_tokens=2)).tokens == [TINY_VOCAB_SIZE, 97, 98]


# ---- Llama 3.1 rope scaling through the sharded loader
TOKENS = [[TINY_VOCAB_SIZE, 5, 17, 42, 99, 7, 3, 250, 11], [TINY_VOCAB_SIZE, 1, 2, 3]]


def _logits(runner):
    first, _ = runner.feed(["a", "b"], [t[:5] for t in TOKENS])
    rest, _ = runner.feed(["a", "b"], TOKENS)
    return torch.cat([first.flatten(), rest.flatten()])


def _rank(rank, world, port, path, out):
    group = init_group(rank, world, port=port, device="cpu")  # gloo, from the device
    model = load_shard(path, torch.float32, rank, world)
    got = _logits(Runner(model, n_slots=2, tp_group=group))
    if rank == 0:  # by value: a shared tensor's fd would die with this process, maybe before the parent reads it
        out.put(got.numpy())
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_llama31_rope_scaling_survives_the_sharded_loader(tmp_path):
    ref = tiny_llama(seed=4)
    ref.save_pretrained(tmp_path)
    one = load_shard(tmp_path, torch.float32)  # the empty-model path, world 1
    assert one.config.rope_scaling["rope_type"] == "llama3"
    inv = one.model.rotary_emb.inv_freq
    assert torch.equal(inv, ref.model.rotary_emb.inv_freq)
    plain = tiny_llama(seed=4, rope_scaling=None).model.rotary_emb.inv_freq
    assert not torch.equal(inv, plain)  # the scaling is really there (low frequencies / 8)

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = torch.from_numpy(out.get(timeout=180))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert torch.allclose(got, _logits(Runner(ref, n_slots=2)), atol=1e-5)


# ---- attention through SDPA's fused paths, decode steps through CUDA graphs
def test_plain_causal_cases_drop_the_mask_and_agree_with_it():
    from torch.nn.attention.bias import CausalBias

    from fly_serve.runtime.runner import attention_mask

    torch.manual_seed(0)
    for starts, T in (([7, 7], 1), ([0, 0], 5), ([4], 3), ([3, 6], 1), ([0, 2], 4)):
        starts = torch.tensor(starts)
        n_keys = int(starts.max()) + T
        pos = starts[:, None] + torch.arange(T)[None, :]
        mask, is_causal = attention_mask(starts, T, n_keys, pos)
        explicit = (torch.arange(n_keys)[None, None, :] <= pos[:, :, None])[:, None]
        equal = bool((starts == starts[0]).all())
        assert (mask is None or isinstance(mask, CausalBias)) == equal  # no mask tensor when plain causal
        q, k, v = (
            torch.randn(len(starts), 4, T, 16),
            torch.randn(len(starts), 2, n_keys, 16),
            torch.randn(len(starts), 2, n_keys, 16),
        )
        sdpa = torch.nn.functional.scaled_dot_product_attention
        got = sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        assert torch.allclose(got, sdpa(q, k, v, attn_mask=explicit, enable_gqa=True), atol=1e-6)


def test_capture_is_chosen_on_cuda_only():
    from fly_serve.runtime.graphs import capture_mode

    assert capture_mode("cpu") == "off"  # auto: a no-op on the CPU
    assert capture_mode("cuda:0") == "graphs"
    assert capture_mode("cuda:0", tp=4) == "off"  # not under TP yet
    assert capture_mode("cuda:0", "off") == "off"
    with pytest.raises(ValueError, match="CUDA device"):
        capture_mode("cpu", "on")
    with pytest.raises(ValueError, match="capture"):
        capture_mode("cuda:0", "always")
    assert Runner(tiny_model(0), n_slots=1).graphs is None


def test_the_captured_step_equals_the_eager_forward():
    from fly_serve.runtime.graphs import DecodeGraphs

    model = tiny_model(0)
    eager, static = Runner(model, n_slots=4), Runner(model, n_slots=4)
    static.graphs = DecodeGraphs(static, replay=False)  # the graph's function, run eagerly on its buffers
    keys = ["a", "b", "c"]
    rows = [[5, 17, 42, 99, 7, 3, 250, 11] * 40, [1, 2, 3], [9] * 300]  # keys pad to buckets 512 / 256
    for runner in (eager, static):
        runner.feed(keys, [r[:-1] for r in rows], logits=False)
    for step in range(2):  # the second step reads the keys the captured step wrote
        rows = [r + [step + 1] for r in rows] if step else rows
        want, _ = eager.feed(keys, rows)
        got, _ = static.feed(keys, rows)
        assert got.shape == want.shape == (3, 1, model.config.vocab_size)
        assert torch.allclose(got, want, atol=1e-5)
    assert static.graphs.replays == 2 and set(static.graphs.static) == {(4, 512)}


def test_a_rank_whose_verdict_is_unread_does_not_sample():
    from fly_serve.contracts import Drafts, Row
    from fly_serve.runtime.model_scorer import ModelScorer

    row = Row(key="a", tokens=[5, 6, 7, 8], k=2, temperature=1.0, seed=3)
    drafts = Drafts([[9, 10]], [torch.full((2, TINY_VOCAB_SIZE), 1.0 / TINY_VOCAB_SIZE)])
    rank0 = ModelScorer(Runner(tiny_model(0), n_slots=1), sample=True)
    other = ModelScorer(Runner(tiny_model(0), n_slots=1), sample=False)
    v0, v1 = rank0.verify([row], drafts), other.verify([row], drafts)
    assert rank0.generators.by_key and not other.generators.by_key  # no generator, no draws
    assert v0.ok.shape == v1.ok.shape


# ---- the draft distribution on the wire
def test_a_top_p_q_travels_sparse_and_verifies_the_same():
    import pickle

    from fly_serve.decision.sampling import probs, speculative_row, wire_q

    torch.manual_seed(0)
    V = 50_000
    q = probs(torch.randn(4, V) * 4, 1.0, top_p=0.9)  # [n, V], a nucleus of a few thousand ids
    p = probs(torch.randn(5, V) * 4, 1.0, top_p=0.9)
    sent = wire_q(q)
    assert sent.is_sparse and len(pickle.dumps(sent)) < len(pickle.dumps(q)) / 5
    assert not wire_q(probs(torch.randn(4, V), 1.0)).is_sparse  # top-p 1: dense is smaller
    drafts = torch.tensor([3, 7, 11, 13])
    dense = speculative_row(p, drafts, 4, q, torch.Generator().manual_seed(1))
    sparse = speculative_row(p, drafts, 4, pickle.loads(pickle.dumps(sent)), torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(dense, sparse))
