"""Target deployment: one replica = one target, behind one interface (`TargetShards`) with two
implementations: `LocalTarget` (tp_size 1: the scorer in the replica's own process, no actor
hop) and `RayTPTarget` (a tensor-parallel group of `tp_size` rank actors).

RayTPTarget: the replica's placement group has one bundle per rank (STRICT_PACK: one node, so the
group talks over local gloo / NCCL). The replica itself sits in bundle 0 and starts a Ray actor
per rank in bundle `rank`; each loads its shard, joins the group and builds a ModelScorer. A
verify() goes to all ranks at once (they all-reduce inside each layer, in lockstep) and rank 0's
result comes back.

Failure: a TP group works only whole, so it is rebuilt only whole. Every call on the ranks has a
timeout; a rank that dies, hangs past the timeout or leaves its peers inside a collective breaks
the group: its ranks are killed, calls fail at once with TPGroupBroken, check_health() raises and
Serve replaces the replica, whose constructor starts a fresh group (new placement group, new
port). The rank actors are owned by the replica, so Ray kills them with it whatever way it dies;
__del__ kills them on a graceful stop without waiting for that.
"""

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import ray
from ray import serve
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.parts.row_history import RowHistory
from deployments.profiles.app_args import (
    DEFAULT_RANK_CALL_TIMEOUT_S,
    DEFAULT_RANK_PING_TIMEOUT_S,
    DEFAULT_TP_STARTUP_TIMEOUT_S,
)
from deployments.routing.replica_pool import PinnedRouter
from fly_serve.build import load_scorer
from fly_serve.config import EngineConfig
from fly_serve.contracts import Drafts, Row, Verdict
from fly_serve.loading.loading import set_threads
from fly_serve.runtime import tp
from fly_serve.runtime.devices import device_for

from .threads import on_torch_thread, on_torch_thread_async, serve_at_priority, threads_from_ray

log = logging.getLogger("ray.serve")

# Serve's controller: a check every period; three failed checks in a row replace the replica (a
# ping is cheap, so a broken group is noticed within seconds).
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0


class TPGroupBroken(RuntimeError):
    """The replica's TP group lost a rank; it serves nothing until Serve replaces the replica."""


@dataclass(frozen=True)
class TargetReport:
    """What a target replica is, for operators and tests."""

    pid: int  # the replica's process
    rank_pids: list[int]  # each rank's process (the replica's own for tp_size 1)
    rank_kv_capacities: list[int]  # tokens each rank's KV cache holds (they must agree)
    rows_verified: int  # rows verified since start (which unit talks to this replica)

    @property
    def tp_size(self) -> int:
        return len(self.rank_pids)


class TargetShards(Protocol):
    """The target as the replica drives it; calls come one at a time (the replica's lock)."""

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict: ...

    def release(self, keys: list[str]) -> None: ...

    def check(self) -> None:
        """Raises unless every shard answers now."""

    def kv_capacities(self) -> list[int]: ...

    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


class LocalTarget:
    def __init__(self, config: EngineConfig, threads: int | None):
        def load():
            set_threads(threads)
            return load_scorer(config, device=device_for(ray.get_gpu_ids()))  # Ray's GPU, else the CPU

        self.scorer = on_torch_thread(load)  # the thread every verify runs on (threads.py)
        self.history = RowHistory()  # rows come with the tokens not sent before (row_history.py)

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return self.scorer.verify(self.history.whole(rows), drafts)

    def release(self, keys: list[str]) -> None:
        self.history.release(keys)
        self.scorer.release(keys)

    def check(self) -> None:
        pass  # the scorer lives in this process: it answers if the replica does

    def kv_capacities(self) -> list[int]:
        return [self.scorer.kv_capacity_tokens]

    def pids(self) -> list[int]:
        return [os.getpid()]

    def close(self) -> None:
        pass


# max_restarts=0: a restarted rank could not rejoin its group (the others hold the old one).
# The "health" group runs ping/pid on a thread of their own, so they answer while a round runs
# (verify and release stay one at a time, in the default group).
@ray.remote(max_restarts=0, concurrency_groups={"health": 1})
class TPWorker:
    """One rank of a target replica's tensor-parallel group."""

    def __init__(
        self, config: EngineConfig, rank: int, world: int, addr: str, port: int, threads, timeout_s: float, nice=None
    ):
        serve_at_priority(nice)

        def load():
            set_threads(threads)
            device = device_for(ray.get_gpu_ids())  # the GPU Ray assigned this rank, else the CPU
            group = tp.init_group(rank, world, addr, port, timeout_s=timeout_s, device=device)
            return load_scorer(config, rank, world, tp_group=group, device=device)

        # Ray runs __init__ and the default group's calls on different threads: all torch work
        # goes to the one torch thread (threads.py)
        self.scorer = on_torch_thread(load)
        # Every rank gets the same calls, so every rank holds the same histories, and a row
        # unknown to one is unknown to all: the group stays in step (RowsUnknown on every rank).
        self.history = RowHistory()

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return on_torch_thread(self.scorer.verify, self.history.whole(rows), drafts)

    def release(self, keys: list[str]) -> None:
        self.history.release(keys)
        on_torch_thread(self.scorer.release, keys)

    # On the health thread: a ping must not queue behind a verify (a long prefill on CPU took past
    # the ping timeout, and the group was rebuilt again and again under load).
    @ray.method(concurrency_group="health")
    def kv_capacity(self) -> int:
        return self.scorer.kv_capacity_tokens

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="health")
    def pid(self) -> int:
        return os.getpid()


def kill_all(workers: list) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # already gone
            pass


class RayTPTarget:
    def __init__(
        self,
        config: EngineConfig,
        tp_size: int,
        threads: int | None,
        worker_options: dict,
        rank_call_timeout_s: float,
        ping_timeout_s: float,
        startup_timeout_s: float,
        nice: int | None = None,
    ):
        self.call_timeout_s, self.ping_timeout_s = rank_call_timeout_s, ping_timeout_s
        self.broken: str | None = None  # why the group is unusable
        self.workers = self._start(config, tp_size, threads, worker_options, startup_timeout_s, nice)
        try:  # every rank up (a no-op call queues behind its constructor)
            ray.get([w.release.remote([]) for w in self.workers], timeout=startup_timeout_s)
        except Exception as e:
            kill_all(self.workers)  # never leave half a group holding the bundles
            raise TPGroupBroken(f"TP group of {tp_size} did not start within {startup_timeout_s} s: {e}") from e

    @staticmethod
    def _start(config, tp_size, threads, worker_options, startup_timeout_s, nice) -> list:
        """tp_size actors, rank r in bundle r of this replica's placement group, on a fresh port."""
        pg = get_current_placement_group()
        addr = ray.util.get_node_ip_address()
        port = tp.free_port(addr)
        workers = []
        for rank in range(tp_size):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank) if pg else None
            actor = TPWorker.options(scheduling_strategy=strategy, **worker_options)
            workers.append(actor.remote(config, rank, tp_size, addr, port, threads, startup_timeout_s, nice))
        return workers

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return self._on_every_rank("verify", rows, drafts)[0]

    def release(self, keys: list[str]) -> None:
        self._on_every_rank("release", keys)

    def check(self) -> None:
        self._break_unless_every_rank_pings()

    def kv_capacities(self) -> list[int]:
        return self._ask_every_rank("kv_capacity")

    def pids(self) -> list[int]:
        return self._ask_every_rank("pid")

    def close(self) -> None:
        kill_all(self.workers)

    def _ask_every_rank(self, method: str) -> list:
        """A health-thread query on every rank (never behind a round)."""
        return ray.get([getattr(w, method).remote() for w in self.workers], timeout=self.ping_timeout_s)

    def _on_every_rank(self, method: str, *args) -> list:
        """`method` on every rank at once; any failure that may leave the ranks out of step
        breaks the group (a later call would pair one rank's collective with another's)."""
        if self.broken:
            raise TPGroupBroken(f"TP group broken ({self.broken}); the replica is being replaced")
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            return ray.get(refs, timeout=self.call_timeout_s)
        except GetTimeoutError as e:
            raise self._break(f"{method} did not finish on every rank within {self.call_timeout_s} s") from e
        except RayActorError as e:
            raise self._break(f"a rank died during {method}: {type(e).__name__}") from e
        except RayTaskError as e:
            # The same error on every rank (a bad row) leaves the group in step; a rank still
            # waiting, or a dead one, does not.
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.ping_timeout_s)
            if pending:
                raise self._break(f"{method} failed on some ranks only") from e
            self._break_unless_every_rank_pings()
            raise

    def _break_unless_every_rank_pings(self) -> None:
        """Raises TPGroupBroken (and breaks the group) unless every rank answers a ping in time."""
        if self.broken:
            raise TPGroupBroken(self.broken)
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=self.ping_timeout_s)
        except GetTimeoutError as e:
            raise self._break(f"a rank did not answer a ping within {self.ping_timeout_s} s") from e
        except RayActorError as e:
            raise self._break(f"a rank is dead: {type(e).__name__}") from e

    def _break(self, reason: str) -> TPGroupBroken:
        """Mark the group unusable and kill its ranks: a survivor may sit in a collective, and its
        bundle is better free for the replacement."""
        if not self.broken:
            self.broken = reason
            log.error("TP group broken: %s; killing its ranks", reason)
            kill_all(self.workers)
        return TPGroupBroken(f"TP group broken ({self.broken}); the replica is being replaced")


@serve.deployment(
    name="FlyTarget",
    ray_actor_options={"num_cpus": 0.2},
    max_ongoing_requests=16,
    autoscaling_config={"min_replicas": 1, "max_replicas": 1},
    # no access-log line for each round's call: on a CPU node every line wakes the log monitor,
    # the GCS and the driver (errors and the replica's own logs still go to its log file)
    logging_config={"enable_access_log": False},
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    # a caller's round in progress finishes before the replica goes
    graceful_shutdown_timeout_s=DEFAULT_RANK_CALL_TIMEOUT_S,
    # a unit's calls (tagged with its ingress replica's rank) go to its own target replica
    request_router_config={"request_router_class": PinnedRouter},
)
class TargetDeployment:
    def __init__(
        self,
        config: EngineConfig,
        *,
        tp_size: int = 1,
        threads: int | None = None,
        worker_options: dict | None = None,
        rank_call_timeout_s: float = DEFAULT_RANK_CALL_TIMEOUT_S,
        ping_timeout_s: float = DEFAULT_RANK_PING_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_TP_STARTUP_TIMEOUT_S,
        nice: int | None = None,
    ):
        serve_at_priority(nice)  # before the model loads: every thread started later inherits it
        self.call_timeout_s = rank_call_timeout_s
        self.lock = threading.Lock()  # one round at a time: the KV cache is not thread-safe
        self.round_started: float | None = None  # monotonic start of the call holding the lock
        self.rows_verified = 0
        if tp_size == 1:
            self.target: TargetShards = LocalTarget(config, threads or threads_from_ray())
        else:
            options = worker_options or {"num_cpus": 0.1}
            self.target = RayTPTarget(
                config, tp_size, threads, options, rank_call_timeout_s, ping_timeout_s, startup_timeout_s, nice
            )

    def __del__(self):
        if hasattr(self, "target"):
            self.target.close()

    # ---- rounds
    async def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return await on_torch_thread_async(self._verify, rows, drafts)  # one OpenMP team (threads.py)

    def _verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        with self._round():
            self.rows_verified += len(rows)
            t0 = time.monotonic()
            verdict = self.target.verify(rows, drafts)
            verdict.compute_s = time.monotonic() - t0  # the caller's call time minus this: transport
            return verdict

    async def release(self, keys: list[str]) -> None:
        await on_torch_thread_async(self._release, keys)

    def _release(self, keys: list[str]) -> None:
        with self._round():
            self.target.release(keys)

    @contextlib.contextmanager
    def _round(self):
        """The lock, with the time the call took it (check_health reads it to spot a hang)."""
        with self.lock:
            self.round_started = time.monotonic()
            try:
                yield
            finally:
                self.round_started = None

    # ---- health
    async def check_health(self) -> None:
        """Raises (Serve then replaces the replica) unless every shard answers and no round hangs."""
        started = self.round_started
        if started is not None and time.monotonic() - started > self.call_timeout_s:
            raise TimeoutError(f"a round has run for over {self.call_timeout_s} s")
        await asyncio.to_thread(self.target.check)

    async def healthy(self) -> bool:
        """check_health for callers (the ingress's prober): True, or it raises."""
        await self.check_health()
        return True

    # ---- what the replica is
    async def kv_capacity(self) -> int:
        """Tokens the KV cache holds, the smallest over the ranks (the engine admits within it)."""
        return min(await asyncio.to_thread(self.target.kv_capacities))

    async def report(self) -> TargetReport:
        pids, kv = await asyncio.to_thread(lambda: (self.target.pids(), self.target.kv_capacities()))
        return TargetReport(os.getpid(), pids, kv, self.rows_verified)
