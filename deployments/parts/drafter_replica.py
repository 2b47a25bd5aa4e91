"""Draft-model deployment: a ModelDrafter (with MLA prompt lookups in-process) per replica,
scaled independently of the target.

Session affinity and scaling (replica_pool.py): each round the ingress splits its rows into one
group per live drafter replica and PinnedRouter sends group i to replica i, so every replica
drafts its share concurrently and a sequence keeps meeting the replica that holds its KV cache.
Correctness never depends on the routing: rows carry all their tokens and a cold replica
rebuilds the cache (counted as a miss). The pool scales on the fraction of time each replica's
model is busy (record_autoscaling_stats, BusyPolicy).

Health: check_health() runs the model on one token, touching no row's KV cache (torch: embedding,
norm and head; llama.cpp: a forward in the sequence id kept for the probe, LlamaRunner.probe); a
replica whose calls hang (the one token is not through within the probe's timeout: it queues
behind the calls on the torch thread) or whose model fails is replaced by Serve. The ingress's
engine drafts by prompt lookup meanwhile (a drafter failure never fails a request).
"""

import asyncio
import os
import re
import threading
import time

import ray
import torch
from ray import serve
from ray.serve import metrics

from deployments.parts.row_history import RowHistory
from deployments.routing.replica_pool import BUSY, BusyPolicy, PinnedRouter
from fly_serve.build import grammars_for, load_drafter
from fly_serve.config import EngineConfig
from fly_serve.contracts import Drafts, Row
from fly_serve.loading.loading import set_threads
from fly_serve.runtime.devices import device_for

from .threads import on_torch_thread, on_torch_thread_async, serve_at_priority, threads_from_ray

PROBE_TIMEOUT_S = 20.0  # the calls before it done (no call stuck) and one token through the model
# Serve's controller: a check every period; three failed checks in a row replace the replica.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
DEPLOYMENT = "FlyDrafter"  # the default drafter's pool; another's is FlyDrafter-<its name>


def deployment_name(name: str | None, default: str | None) -> str:
    """The Serve deployment of the drafter of this name (the engine's default: DEPLOYMENT)."""
    if name is None or name == default:
        return DEPLOYMENT
    return f"{DEPLOYMENT}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"


@serve.deployment(
    name=DEPLOYMENT,
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=16,
    # no access-log line for each round's call: on a CPU node every line wakes the log monitor,
    # the GCS and the driver (errors and the replica's own logs still go to its log file)
    logging_config={"enable_access_log": False},
    # Profiles raise max_replicas; the pool then scales on busy time (BusyPolicy), not requests.
    autoscaling_config={
        "min_replicas": 1,
        "max_replicas": 1,
        "policy": {"policy_function": BusyPolicy, "policy_kwargs": {"target": 0.6}},
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 60.0,
    },
    request_router_config={"request_router_class": PinnedRouter},
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    graceful_shutdown_timeout_s=30.0,  # a caller's drafting call in progress finishes first
)
class DrafterDeployment:
    def __init__(
        self,
        config: EngineConfig,
        *,
        threads: int | None = None,
        nice: int | None = None,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        drafter: str | None = None,
    ):
        """drafter: which of the config's draft models (by name; None: the default)."""
        serve_at_priority(nice)  # before the model loads: every thread started later inherits it
        self.probe_timeout_s = probe_timeout_s

        def load():
            set_threads(threads or threads_from_ray())
            return load_drafter(config, device=device_for(ray.get_gpu_ids()), name=drafter)  # Ray's GPU, else the CPU

        # one of another tokenizer than the target's drafts through their vocabulary map
        # (build.drafter_part); loaded, drafting and probed on one thread: one OpenMP team (threads.py)
        self.drafter = on_torch_thread(load)
        # structured output: constrained rows drafted under their grammar (Row.grammar), with a
        # matcher per row here; the ingress's engine keeps the authoritative one
        self.drafter.share_grammars(grammars_for(config))
        self.history = RowHistory()  # rows come with the tokens not sent before (row_history.py)
        # ModelDrafter is not thread-safe; Serve may run several calls of one replica at once (the
        # torch thread takes them in turn; the lock keeps that so if a call ever runs elsewhere).
        self.lock = threading.Lock()
        self.hits = metrics.Counter("fly_drafter_cache_hits", "Rows whose drafter KV cache was warm.")
        self.misses = metrics.Counter("fly_drafter_cache_misses", "Rows the drafter had to prefill.")
        self.hit_rate = metrics.Gauge("fly_drafter_cache_hit_rate", "hits / (hits + misses) since start.")
        self.evictions = metrics.Counter(
            "fly_drafter_rows_evicted", "Rows the drafter's llama.cpp cache evicted while held (each prefills again)."
        )
        self._evicted_seen = 0
        self.rows = 0  # rows drafted since start
        self.busy_s = 0.0  # seconds the model drafted since start
        self._reported = (time.monotonic(), 0.0, 0)  # (when, busy_s, rows) at the last stats report
        self.last_done = time.monotonic()  # when a call on the torch thread last finished

    async def propose(self, rows: list[Row]) -> Drafts:
        return await on_torch_thread_async(self._propose, rows)

    def _propose(self, rows: list[Row]) -> Drafts:
        with self.lock:
            hits, misses = self.drafter.hits, self.drafter.misses
            t0 = time.monotonic()
            try:
                out = self.drafter.propose(self.history.whole(rows))
                out.compute_s = time.monotonic() - t0  # the caller's call time minus this: transport
            finally:
                self.busy_s += time.monotonic() - t0
                self.rows += len(rows)
                self.last_done = time.monotonic()
            evicted = self._rows_evicted()
            counts = ((self.hits, self.drafter.hits - hits), (self.misses, self.drafter.misses - misses))
            for counter, n in (*counts, (self.evictions, evicted - self._evicted_seen)):
                if n > 0:  # Ray counters reject 0
                    counter.inc(n)
            self._evicted_seen = evicted
            self.hit_rate.set(self.cache_report()["hit_rate"])
            return out

    async def release(self, keys: list[str]) -> None:
        await on_torch_thread_async(self._release, keys)

    def _release(self, keys: list[str]) -> None:
        with self.lock:
            self.history.release(keys)
            self.drafter.release(keys)
            self.last_done = time.monotonic()

    def cache_report(self) -> dict:
        return self.drafter.cache_report() | {"rows": self.rows, "busy_s": self.busy_s, "evicted": self._rows_evicted()}

    def _rows_evicted(self) -> int:
        """Rows the llama.cpp cache evicted while held (0 on torch, whose cache counts none)."""
        return getattr(getattr(self.drafter.runner, "cache", None), "evicted", 0)

    # ---- autoscaling: the signal the drafter really sees
    def record_autoscaling_stats(self) -> dict[str, float]:
        """Busy fraction and rows drafted per second since the last report (Serve asks about
        every few seconds; BusyPolicy sums the busy fractions over the pool)."""
        now, busy_s, rows = time.monotonic(), self.busy_s, self.rows
        then, busy_then, rows_then = self._reported
        self._reported = (now, busy_s, rows)
        dt = max(now - then, 1e-6)
        return {BUSY: min(1.0, (busy_s - busy_then) / dt), "draft_rows_per_s": (rows - rows_then) / dt}

    # ---- health
    async def check_health(self) -> None:
        """Raises (Serve then replaces the replica) unless the model answers in time."""
        try:
            await asyncio.wait_for(on_torch_thread_async(self._probe), self.probe_timeout_s)
        except TimeoutError:
            # queued behind drafting calls that keep finishing: busy, not stuck
            if time.monotonic() - self.last_done < self.probe_timeout_s:
                return
            raise TimeoutError(f"no drafter call has finished for over {self.probe_timeout_s} s") from None

    async def healthy(self) -> bool:
        """check_health for callers (the ingress's prober): True, or it raises."""
        await self.check_health()
        return True

    def _probe(self) -> None:
        with self.lock:
            logits = self._one_token_logits()
        if not torch.isfinite(logits).all():
            raise RuntimeError("the draft model returns non-finite logits")

    def _one_token_logits(self) -> torch.Tensor:
        """Embedding, final norm and head on one token: the weights are there and compute, and no
        sequence's KV cache is touched."""
        runner = self.drafter.runner
        model = runner.model
        if not isinstance(model, torch.nn.Module):  # llama.cpp: the probe's own sequence id, no row's
            logits = runner.probe()
            return torch.zeros(1) if logits is None else logits  # None: cache full, the model answered
        with torch.inference_mode():
            h = model.model.embed_tokens(torch.zeros(1, 1, dtype=torch.long, device=self.drafter.runner.device))
            return model.lm_head(model.model.norm(h))

    def pid(self) -> int:
        return os.getpid()
