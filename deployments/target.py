"""Target deployment: one replica = one tensor-parallel group of `tp_size` workers.

The replica's placement group has one bundle per worker (STRICT_PACK: one node, so the group
talks over local gloo / NCCL). The replica itself sits in bundle 0 and starts a Ray actor per
rank in bundle `rank`; each loads the model, shards it, joins the group and builds a Target.
A score() call goes to all ranks at once (they all-reduce inside each layer, in lockstep) and
rank 0's result comes back. tp_size=1 runs the Target inside the replica, with no actor hop.
"""
import asyncio
import socket
import threading

import ray
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fly_serve import tp
from fly_serve.target import Target

from . import models


def build_target(name: str, dtype: str, n_slots: int, rank: int = 0, world: int = 1,
                 addr: str = "127.0.0.1", port: int = 0, threads: int | None = None) -> Target:
    models.set_threads(threads)
    group = None
    if world > 1:
        group = tp.init_group(rank, world, addr, port)
    model = models.target_model(name, dtype, rank, world)
    return Target(model, n_slots=n_slots, tp_group=group)


@ray.remote
class TPWorker:
    """One rank of a target replica's tensor-parallel group."""

    def __init__(self, *args, **kwargs):
        self.target = build_target(*args, **kwargs)

    def score(self, rows, drafts, qs, kinds):
        return self.target.score(rows, drafts, qs, kinds)

    def release(self, keys):
        self.target.release(keys)


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
        workers.append(TPWorker.options(scheduling_strategy=strategy, **worker_options).remote(
            name, dtype, n_slots, rank, tp_size, addr, port, threads))
    return workers


@serve.deployment(name="FlyTarget", ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=16,
                  autoscaling_config={"min_replicas": 1, "max_replicas": 1})
class TargetDeployment:
    def __init__(self, target: str, dtype: str = "bf16", tp_size: int = 1, n_slots: int = 8,
                 threads: int | None = None, worker_options: dict | None = None):
        self.lock = threading.Lock()  # one round at a time: the KV cache is not thread-safe
        if tp_size == 1:
            self.local, self.workers = build_target(target, dtype, n_slots, threads=threads), []
        else:
            self.local = None
            self.workers = start_workers(target, dtype, n_slots, tp_size, threads,
                                         worker_options or {"num_cpus": 0.1})
            ray.get([w.release.remote([]) for w in self.workers])  # wait until every rank is up

    async def score(self, rows, drafts, qs, kinds):
        return await asyncio.to_thread(self._score, rows, drafts, qs, kinds)

    def _score(self, rows, drafts, qs, kinds):
        with self.lock:
            if self.local is not None:
                return self.local.score(rows, drafts, qs, kinds)
            return ray.get([w.score.remote(rows, drafts, qs, kinds) for w in self.workers])[0]

    async def release(self, keys):
        await asyncio.to_thread(self._release, keys)

    def _release(self, keys):
        with self.lock:
            if self.local is not None:
                self.local.release(keys)
            else:
                ray.get([w.release.remote(keys) for w in self.workers])

    def tp_size(self) -> int:
        return max(1, len(self.workers))
