"""Target deployment: one replica = one tensor-parallel group of `tp_size` workers.

The replica's placement group has one bundle per worker (STRICT_PACK: one node, so the group
talks over local gloo / NCCL). The replica itself sits in bundle 0 and starts a Ray actor per
rank in bundle `rank`; each loads its shard, joins the group and builds a ModelScorer. A verify()
call goes to all ranks at once (they all-reduce inside each layer, in lockstep) and rank 0's
result comes back. tp_size=1 runs the scorer inside the replica, with no actor hop.
"""

import asyncio
import socket
import threading

import ray
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fly_serve import tp
from fly_serve.contracts import Drafts, Row, Verdict
from fly_serve.loading import load_model, load_tokenizer, set_threads
from fly_serve.model_scorer import ModelScorer


def build_scorer(
    name: str,
    dtype: str,
    n_slots: int,
    rank: int = 0,
    world: int = 1,
    addr: str = "127.0.0.1",
    port: int = 0,
    threads: int | None = None,
) -> ModelScorer:
    set_threads(threads)
    group = tp.init_group(rank, world, addr, port) if world > 1 else None
    return ModelScorer(
        load_model(name, dtype, rank, world), n_slots=n_slots, tp_group=group, vocab_size=len(load_tokenizer(name))
    )


@ray.remote
class TPWorker:
    """One rank of a target replica's tensor-parallel group."""

    def __init__(self, *args, **kwargs):
        self.scorer = build_scorer(*args, **kwargs)

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return self.scorer.verify(rows, drafts)

    def release(self, keys: list[str]) -> None:
        self.scorer.release(keys)


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def start_workers(name, dtype, n_slots, tp_size, threads, worker_options):
    """tp_size actors, rank r in bundle r of this replica's placement group."""
    pg = get_current_placement_group()
    addr = ray.util.get_node_ip_address()
    port = free_port(addr)
    workers = []
    for rank in range(tp_size):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank) if pg else None
        workers.append(
            TPWorker.options(scheduling_strategy=strategy, **worker_options).remote(
                name, dtype, n_slots, rank, tp_size, addr, port, threads
            )
        )
    return workers


@serve.deployment(
    name="FlyTarget",
    ray_actor_options={"num_cpus": 0.2},
    max_ongoing_requests=16,
    autoscaling_config={"min_replicas": 1, "max_replicas": 1},
)
class TargetDeployment:
    def __init__(
        self,
        target: str,
        dtype: str = "bf16",
        tp_size: int = 1,
        n_slots: int = 8,
        threads: int | None = None,
        worker_options: dict | None = None,
    ):
        self.lock = threading.Lock()  # one round at a time: the KV cache is not thread-safe
        if tp_size == 1:
            self.local, self.workers = build_scorer(target, dtype, n_slots, threads=threads), []
        else:
            self.local = None
            self.workers = start_workers(target, dtype, n_slots, tp_size, threads, worker_options or {"num_cpus": 0.1})
            ray.get([w.release.remote([]) for w in self.workers])  # wait until every rank is up

    async def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return await asyncio.to_thread(self._verify, rows, drafts)

    def _verify(self, rows, drafts):
        with self.lock:
            if self.local is not None:
                return self.local.verify(rows, drafts)
            return ray.get([w.verify.remote(rows, drafts) for w in self.workers])[0]

    async def release(self, keys: list[str]) -> None:
        await asyncio.to_thread(self._release, keys)

    def _release(self, keys):
        with self.lock:
            if self.local is not None:
                self.local.release(keys)
            else:
                ray.get([w.release.remote(keys) for w in self.workers])

    def tp_size(self) -> int:
        return max(1, len(self.workers))
