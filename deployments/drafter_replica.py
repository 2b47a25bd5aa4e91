"""Draft-model deployment: a ModelDrafter (with MLA prompt lookups in-process) per replica,
scaled independently of the target.

Session affinity: the ingress calls each group of rows with multiplexed_model_id="g<n>", and
Serve's multiplexing routes a model id to a replica that has already "loaded" it, so a sequence
keeps meeting the replica that holds its KV cache. The "model" is only a group label (cheap);
correctness never depends on the routing because rows carry all their tokens and a cold replica
rebuilds the cache (counted as a miss).

Health: check_health() runs the model on one token; a replica whose calls hang (the lock is not
free within the probe's timeout) or whose model fails is replaced by Serve. The ingress's engine
drafts by prompt lookup meanwhile (a drafter failure never fails a request).
"""

import asyncio
import os
import threading

import torch
from ray import serve
from ray.serve import metrics

from fly_serve.contracts import Drafts, Row
from fly_serve.drafters import ModelDrafter
from fly_serve.loading import load_model, load_tokenizer, set_threads

from .prometheus import inc

PROBE_TIMEOUT_S = 20.0  # the lock free (no call stuck) and one token through the model
# Serve's controller: a check every period; three failed checks in a row replace the replica.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0


@serve.deployment(
    name="FlyDrafter",
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=16,
    autoscaling_config={"min_replicas": 1, "max_replicas": 1},
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    graceful_shutdown_timeout_s=30.0,  # a caller's drafting call in progress finishes first
)
class DrafterDeployment:
    def __init__(
        self,
        drafter: str,
        precision: str = "int8",
        n_slots: int = 8,
        threads: int | None = None,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ):
        set_threads(threads)
        self.probe_timeout_s = probe_timeout_s
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

    # ---- health
    async def check_health(self) -> None:
        """Raises (Serve then replaces the replica) unless the model answers in time."""
        await asyncio.to_thread(self._probe)

    def _probe(self) -> None:
        if not self.lock.acquire(timeout=self.probe_timeout_s):
            raise TimeoutError(f"a drafter call has held the model for over {self.probe_timeout_s} s")
        try:
            logits = self._one_token_logits()
        finally:
            self.lock.release()
        if not torch.isfinite(logits).all():
            raise RuntimeError("the draft model returns non-finite logits")

    def _one_token_logits(self) -> torch.Tensor:
        """Embedding, final norm and head on one token: the weights are there and compute, and no
        sequence's KV cache is touched."""
        model = self.drafter.runner.model
        with torch.inference_mode():
            h = model.model.embed_tokens(torch.zeros(1, 1, dtype=torch.long, device=self.drafter.runner.device))
            return model.lm_head(model.model.norm(h))

    def pid(self) -> int:
        return os.getpid()
