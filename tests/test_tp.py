"""TP = 2 over gloo on the CPU gives the logits of TP = 1 (fp32 tolerance), with the prefix cache:
every rank adopts the same blocks (a third row sharing the first one's prefix)."""

import torch
import torch.multiprocessing as mp

from fly_serve.loading.tiny import tiny_model
from fly_serve.runtime.runner import Runner
from fly_serve.runtime.tp import free_port, init_group, shard

TOKENS = [[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3]]


def logits_of(runner):
    first, _ = runner.feed(["a", "b"], [t[:5] for t in TOKENS])  # prefill part ...
    rest, _ = runner.feed(["a", "b"], TOKENS)  # ... then extend from the cache
    shared, fed = runner.feed(["c"], [TOKENS[0] + [77]])  # adopts a's two full blocks of 4
    assert fed == [1] and runner.cache.take_hits(["c"]) == [8]
    return first, rest, shared


def runner(model, **kw) -> Runner:
    return Runner(model, n_slots=4, block_size=4, prefix_cache=True, **kw)


def _worker(rank, world, port, out):
    group = init_group(rank, world, port=port, backend="gloo")
    model = shard(tiny_model(seed=3), rank, world)
    got = logits_of(runner(model, tp_group=group))
    if rank == 0:  # by value: a shared tensor's fd would die with this process, maybe before the parent reads it
        out.put([t.numpy() for t in got])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_tp2_equals_tp1():
    ref_first, ref_rest, ref_shared = logits_of(runner(tiny_model(seed=3)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, PORT, out)) for r in range(2)]
    for p in procs:
        p.start()
    first, rest, shared = (torch.from_numpy(a) for a in out.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert torch.allclose(first, ref_first, atol=1e-5)
    assert torch.allclose(rest, ref_rest, atol=1e-5)
    assert torch.allclose(shared, ref_shared, atol=1e-5)
    assert not torch.allclose(rest[0], rest[1])  # the rows are really different sequences


PORT = free_port()
