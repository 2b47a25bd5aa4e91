"""load_shard reads only a rank's slices from the safetensors files and gives exactly tp.shard's shard."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fly_serve.loading.sharded_load import INDEX, load_shard
from fly_serve.loading.tiny import tiny_llama, tiny_model
from fly_serve.loading.weights import DEFAULT_TARGET, cache_dir
from fly_serve.runtime import tp
from fly_serve.runtime.runner import Runner

SEED = 3
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11]
REPO = Path(__file__).resolve().parents[1]


def assert_same_state(got: torch.nn.Module, ref: torch.nn.Module):
    """Same keys, dtypes, shapes and values (bit for bit), and the same Linear shapes."""
    a, b = got.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    lin = {n: (m.in_features, m.out_features) for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {n: (m.in_features, m.out_features) for n, m in got.named_modules() if n in lin} == lin


def assert_ready(model: torch.nn.Module):
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module", params=["single", "index"])
def tiny_dir(request, tmp_path_factory) -> Path:
    """tiny_model(SEED) saved as one file, or split over several with an index file."""
    path = tmp_path_factory.mktemp(request.param)
    extra = {"max_shard_size": "100KB"} if request.param == "index" else {}
    tiny_model(seed=SEED).save_pretrained(path, **extra)
    assert (path / INDEX).is_file() == (request.param == "index")
    assert len(list(path.glob("*.safetensors"))) > 1 or request.param == "single"
    return path


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_equals_tp_shard(tiny_dir, rank):
    got = load_shard(tiny_dir, torch.float32, rank, 2)
    assert_same_state(got, tp.shard(tiny_model(seed=SEED), rank, 2))
    assert_ready(got)
    assert got.model.layers[0].self_attn.q_proj.out_features == 32  # really half of 4 heads x 16
    assert got.lm_head.weight is got.model.embed_tokens.weight  # tied, as in the file (no lm_head there)


def test_world1_equals_full_model(tiny_dir):
    got, ref = load_shard(tiny_dir, torch.float32), tiny_model(seed=SEED)
    assert_same_state(got, ref)
    assert_ready(got)
    buffers = dict(ref.named_buffers())  # rotary inv_freq: recomputed, not left on meta
    assert {k: torch.equal(v, buffers[k]) for k, v in got.named_buffers()} == dict.fromkeys(buffers, True)


def test_runner_logits_world1(tiny_dir):
    got = Runner(load_shard(tiny_dir, torch.float32), n_slots=1).feed(["a"], [TOKENS])[0]
    ref = tiny_model(seed=SEED)
    assert torch.equal(got, Runner(ref, n_slots=1).feed(["a"], [TOKENS])[0])
    with torch.inference_mode():
        hf = ref(torch.tensor([TOKENS])).logits
    assert torch.allclose(got, hf, atol=1e-5)


def test_bf16_equals_from_pretrained(tiny_dir):
    got = load_shard(tiny_dir, torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert_same_state(got, ref)
    ref_buffers = dict(ref.named_buffers())
    for k, v in got.named_buffers():
        assert v.dtype == ref_buffers[k].dtype and torch.equal(v, ref_buffers[k]), k


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_bias_and_untied_head(tmp_path, rank):
    """Biases on o/down (row-parallel: rank 0 only) and an lm_head of its own in the file."""

    def make():
        model = tiny_llama(SEED, vocab_size=97, attention_bias=True, mlp_bias=True)
        torch.manual_seed(SEED)
        for p in model.parameters():  # biases start at zero: make them visible
            p.uniform_(-1, 1)
        return model

    make().save_pretrained(tmp_path)
    got = load_shard(tmp_path, torch.float32, rank, 2)
    assert_same_state(got, tp.shard(make(), rank, 2))
    assert got.lm_head.weight is not got.model.embed_tokens.weight
    down_bias = got.model.layers[0].mlp.down_proj.bias
    assert bool(down_bias.any()) == (rank == 0)


def test_checks(tiny_dir):
    with pytest.raises(ValueError, match="tp_size"):
        load_shard(tiny_dir, torch.float32, 0, 3)  # 3 divides neither 4 heads nor 2 KV heads
    with pytest.raises(ValueError, match="tp_size"):
        load_shard(tiny_dir, torch.float32, 2, 2)


# --- the real default target at TP = 2 -------------------------------------------------------

TARGET_DIR = cache_dir() / f"{DEFAULT_TARGET}-hf"

# Each load runs in a fresh process, so that its peak memory is its own. Two figures: the peak
# RSS (ru_maxrss), and the peak of the process's private memory (RssAnon + RssShmem, polled). The
# RSS also counts the pages of the memory-mapped checkpoint that a read touched: those are the
# kernel's page cache, shared by every rank of a node and reclaimable, and how many of them stay
# mapped depends on the page cache's state (after the rest of the suite a rank's RSS once
# measured 8.7 GB against 3.4 GB alone, its private memory unchanged). So the bound on a rank is
# on its private memory, the memory that adds up across ranks.
PEAK = """
import resource, sys, threading, time, torch
kind, path = sys.argv[1], sys.argv[2]
peak, done = [0], threading.Event()
def private_mb():
    f = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return (int(f["RssAnon"].split()[0]) + int(f["RssShmem"].split()[0])) / 1024
def poll():
    while not done.is_set():
        peak[0] = max(peak[0], private_mb())
        time.sleep(0.002)
watcher = threading.Thread(target=poll)
watcher.start()
if kind == "full":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
else:
    from fly_serve.loading.sharded_load import load_shard
    model = load_shard(path, torch.bfloat16, int(kind), 2)
done.set()
watcher.join()
peak[0] = max(peak[0], private_mb())
weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict().values()}.values())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak[0], weights / 2**20)  # MB
"""

SAME = """
import sys, torch
from transformers import AutoModelForCausalLM
from fly_serve.runtime import tp
from fly_serve.loading.sharded_load import load_shard
rank, path = int(sys.argv[1]), sys.argv[2]
ref = tp.shard(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rank, 2).state_dict()
got = load_shard(path, torch.float32, rank, 2).state_dict()
assert got.keys() == ref.keys(), got.keys() ^ ref.keys()
diff = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
assert not diff, diff
"""


def python(code: str, *args: str) -> str:
    # A clean environment: what earlier tests left in os.environ (Ray's, the serve fixture's)
    # must not change how a fresh process loads and so what its peak memory is.
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "FLY_SERVE_CACHE") if k in os.environ}
    env = dict(keep, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def target_dir() -> Path:
    """The default target converted to safetensors (the first use converts it, ~2 min, as any
    load of it would): when the test runs, not a condition read at collection."""
    from fly_serve.loading.weights import resolve

    path = Path(resolve(DEFAULT_TARGET))
    assert path == TARGET_DIR and path.is_dir(), path
    return path


@pytest.mark.real
def test_real_target_tp2_peak_memory(target_dir):
    rss, private, weights = {}, {}, {}
    for kind in ("full", "0", "1"):
        rss[kind], private[kind], weights[kind] = map(float, python(PEAK, kind, str(target_dir)).split()[-3:])
    print(
        f"\nbf16 load of {DEFAULT_TARGET} (MB): peak RSS full {rss['full']:.0f}, rank 0 {rss['0']:.0f}, "
        f"rank 1 {rss['1']:.0f}; peak private memory full {private['full']:.0f}, rank 0 {private['0']:.0f}, "
        f"rank 1 {private['1']:.0f}; weights full {weights['full']:.0f}, rank 0 {weights['0']:.0f}"
    )
    constant = private["full"] - weights["full"]  # the runtime (torch, transformers), without weights
    for rank in ("0", "1"):
        assert private[rank] <= 0.6 * rss["full"], (private, rss)
        # about 1/TP of the weights plus the runtime: the embedding (a third of this model) is
        # replicated on every rank, so this rank's weights are over half of the model's
        assert weights[rank] < 0.7 * weights["full"], weights
        assert private[rank] <= weights[rank] + constant + 256, (private, weights)


@pytest.mark.real
@pytest.mark.parametrize("rank", [0, 1])
def test_real_target_tp2_equals_tp_shard(rank, target_dir):
    python(SAME, str(rank), str(target_dir))  # fp32, exact; asserts in the child
