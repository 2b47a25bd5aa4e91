"""Draft-model deployment: a ModelDrafter (with MLA prompt lookups in-process) per replica,
scaled independently of the target.

Session affinity: the ingress calls each group of rows with multiplexed_model_id="g<n>", and
Serve's multiplexing routes a model id to a replica that has already "loaded" it, so a sequence
keeps meeting the replica that holds its KV cache. The "model" is only a group label (cheap);
correctness never depends on the routing because rows carry all their tokens and a cold replica
rebuilds the cache (counted as a miss).
"""

import asyncio
import threading

from ray import serve
from ray.serve import metrics

from fly_serve.contracts import Drafts, Row
from fly_serve.drafters import ModelDrafter
from fly_serve.loading import load_model, load_tokenizer, set_threads

from .prometheus import inc


@serve.deployment(
    name="FlyDrafter",
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=16,
    autoscaling_config={"min_replicas": 1, "max_replicas": 1},
)
class DrafterDeployment:
    def __init__(self, drafter: str, precision: str = "int8", n_slots: int = 8, threads: int | None = None):
        set_threads(threads)
        # its logits are cut to the tokenizer's tokens, as the target's (the ingress checks that
        # the two tokenizers agree)
        self.drafter = ModelDrafter(
            load_model(drafter, precision), n_slots=n_slots, vocab_size=len(load_tokenizer(drafter))
        )
        # ModelDrafter is not thread-safe; Serve may run several calls of one replica at once.
        self.lock = threading.Lock()
        self.hits = metrics.Counter("fly_drafter_cache_hits", "Rows whose drafter KV cache was warm.")
        self.misses = metrics.Counter("fly_drafter_cache_misses", "Rows the drafter had to prefill.")
        self.hit_rate = metrics.Gauge("fly_drafter_cache_hit_rate", "hits / (hits + misses) since start.")

    @serve.multiplexed(max_num_models_per_replica=64)
    async def group(self, group_id: str) -> str:
        return group_id  # only registers the id with this replica, for the router

    async def propose(self, rows: list[Row]) -> Drafts:
        await self.group(serve.get_multiplexed_model_id())
        return await asyncio.to_thread(self._propose, rows)

    def _propose(self, rows: list[Row]) -> Drafts:
        with self.lock:
            hits, misses = self.drafter.hits, self.drafter.misses
            out = self.drafter.propose(rows)
            inc(self.hits, self.drafter.hits - hits)
            inc(self.misses, self.drafter.misses - misses)
            self.hit_rate.set(self.cache_report()["hit_rate"])
            return out

    async def release(self, keys: list[str]) -> None:
        await asyncio.to_thread(self._release, keys)

    def _release(self, keys: list[str]) -> None:
        with self.lock:
            self.drafter.release(keys)

    def cache_report(self) -> dict:
        d = self.drafter
        seen = d.hits + d.misses
        return {"hits": d.hits, "misses": d.misses, "hit_rate": d.hits / seen if seen else 0.0, "forwards": d.forwards}
