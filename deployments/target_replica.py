"""Target deployment: one replica = one tensor-parallel group of `tp_size` workers.

The replica's placement group has one bundle per worker (STRICT_PACK: one node, so the group
talks over local gloo / NCCL). The replica itself sits in bundle 0 and starts a Ray actor per
rank in bundle `rank`; each loads its shard, joins the group and builds a ModelScorer. A verify()
call goes to all ranks at once (they all-reduce inside each layer, in lockstep) and rank 0's
result comes back. tp_size=1 runs the scorer inside the replica, with no actor hop.

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
import socket
import threading
import time

import ray
from ray import serve
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fly_serve import tp
from fly_serve.contracts import Drafts, Row, Verdict
from fly_serve.devices import device_for
from fly_serve.loading import load_model, load_tokenizer, set_threads
from fly_serve.model_scorer import ModelScorer

from .replica_pool import PinnedRouter

log = logging.getLogger("ray.serve")

ROUND_TIMEOUT_S = 60.0  # one verify or release on every rank
STARTUP_TIMEOUT_S = 600.0  # every rank started, joined the group and loaded its shard
PING_TIMEOUT_S = 10.0  # a rank answers a ping (on its own thread, so not behind a round)
# Serve's controller: a check every period; three failed checks in a row replace the replica (a
# ping is cheap, so a broken group is noticed within seconds).
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0


class TPGroupBroken(RuntimeError):
    """The replica's TP group lost a rank; it serves nothing until Serve replaces the replica."""


def build_scorer(
    name: str,
    dtype: str,
    n_slots: int,
    rank: int = 0,
    world: int = 1,
    addr: str = "127.0.0.1",
    port: int = 0,
    threads: int | None = None,
    group_timeout_s: float = STARTUP_TIMEOUT_S,
    kv_budget_tokens: int | None = None,
) -> ModelScorer:
    """One rank's scorer. kv_budget_tokens is a token count, the same on every rank, so that the
    ranks take the same block decisions (a byte budget from each rank's free memory could differ)."""
    set_threads(threads)
    device = device_for(ray.get_gpu_ids())  # the GPU Ray assigned this rank, else the CPU
    group = tp.init_group(rank, world, addr, port, timeout_s=group_timeout_s, device=device) if world > 1 else None
    return ModelScorer(
        load_model(name, dtype, rank, world, device=device),
        n_slots=n_slots,
        tp_group=group,
        vocab_size=len(load_tokenizer(name)),
        kv_budget_tokens=kv_budget_tokens,
        sample=rank == 0,  # only rank 0's verdict is read (_on_ranks(...)[0])
    )


# max_restarts=0: a restarted rank could not rejoin its group (the others hold the old one).
# The "health" group runs ping/pid on a thread of their own, so they answer while a round runs
# (verify and release stay one at a time, in the default group).
@ray.remote(max_restarts=0, concurrency_groups={"health": 1})
class TPWorker:
    """One rank of a target replica's tensor-parallel group."""

    def __init__(self, *args, **kwargs):
        self.scorer = build_scorer(*args, **kwargs)

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return self.scorer.verify(rows, drafts)

    def release(self, keys: list[str]) -> None:
        self.scorer.release(keys)

    @ray.method(concurrency_group="health")
    def kv_capacity(self) -> int:
        return self.scorer.kv_capacity_tokens

    # On the health thread: a ping must not queue behind a verify (a long prefill on CPU took past
    # the ping timeout, and the group was rebuilt again and again under load).
    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="health")
    def pid(self) -> int:
        return os.getpid()


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def start_workers(
    name: str,
    dtype: str,
    n_slots: int,
    tp_size: int,
    threads: int | None,
    worker_options: dict,
    group_timeout_s: float,
    kv_budget_tokens: int | None = None,
) -> list:
    """tp_size actors, rank r in bundle r of this replica's placement group, on a fresh port."""
    pg = get_current_placement_group()
    addr = ray.util.get_node_ip_address()
    port = free_port(addr)
    workers = []
    for rank in range(tp_size):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank) if pg else None
        workers.append(
            TPWorker.options(scheduling_strategy=strategy, **worker_options).remote(
                name, dtype, n_slots, rank, tp_size, addr, port, threads, group_timeout_s, kv_budget_tokens
            )
        )
    return workers


def kill_all(workers: list) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # already gone
            pass


@serve.deployment(
    name="FlyTarget",
    ray_actor_options={"num_cpus": 0.2},
    max_ongoing_requests=16,
    autoscaling_config={"min_replicas": 1, "max_replicas": 1},
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    # a caller's round in progress finishes before the replica goes
    graceful_shutdown_timeout_s=ROUND_TIMEOUT_S,
    # a unit's calls (tagged with its ingress replica's rank) go to its own target replica
    request_router_config={"request_router_class": PinnedRouter},
)
class TargetDeployment:
    def __init__(
        self,
        target: str,
        dtype: str = "auto",
        tp_size: int = 1,
        n_slots: int = 8,
        threads: int | None = None,
        worker_options: dict | None = None,
        round_timeout_s: float = ROUND_TIMEOUT_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        ping_timeout_s: float = PING_TIMEOUT_S,
        kv_budget_tokens: int | None = None,
    ):
        self.round_timeout_s, self.ping_timeout_s = round_timeout_s, ping_timeout_s
        self.lock = threading.Lock()  # one round at a time: the KV cache is not thread-safe
        self.broken: str | None = None  # why the TP group is unusable
        self.round_started: float | None = None  # monotonic start of the call holding the lock
        self.local, self.workers = None, []
        self.rows_verified = 0  # rows verified since start (which unit talks to this replica)
        if tp_size == 1:
            self.local = build_scorer(target, dtype, n_slots, threads=threads, kv_budget_tokens=kv_budget_tokens)
            return
        options = worker_options or {"num_cpus": 0.1}
        self.workers = start_workers(
            target, dtype, n_slots, tp_size, threads, options, startup_timeout_s, kv_budget_tokens
        )
        try:  # every rank up (a no-op call queues behind its constructor)
            ray.get([w.release.remote([]) for w in self.workers], timeout=startup_timeout_s)
        except Exception as e:
            kill_all(self.workers)  # never leave half a group holding the bundles
            raise TPGroupBroken(f"TP group of {tp_size} did not start within {startup_timeout_s} s: {e}") from e

    def __del__(self):
        kill_all(getattr(self, "workers", []))

    # ---- rounds
    async def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return await asyncio.to_thread(self._verify, rows, drafts)

    def _verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        self.rows_verified += len(rows)
        with self._round():
            if self.local is not None:
                return self.local.verify(rows, drafts)
            return self._on_ranks("verify", rows, drafts)[0]

    async def release(self, keys: list[str]) -> None:
        await asyncio.to_thread(self._release, keys)

    def _release(self, keys: list[str]) -> None:
        with self._round():
            if self.local is not None:
                self.local.release(keys)
            else:
                self._on_ranks("release", keys)

    @contextlib.contextmanager
    def _round(self):
        """The lock, with the time the call took it (check_health reads it to spot a hang)."""
        with self.lock:
            self.round_started = time.monotonic()
            try:
                yield
            finally:
                self.round_started = None

    def _on_ranks(self, method: str, *args) -> list:
        """`method` on every rank at once; any failure that may leave the ranks out of step
        breaks the group (a later call would pair one rank's collective with another's)."""
        if self.broken:
            raise TPGroupBroken(f"TP group broken ({self.broken}); the replica is being replaced")
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            return ray.get(refs, timeout=self.round_timeout_s)
        except GetTimeoutError as e:
            raise self._break(f"{method} did not finish on every rank within {self.round_timeout_s} s") from e
        except RayActorError as e:
            raise self._break(f"a rank died during {method}: {type(e).__name__}") from e
        except RayTaskError as e:
            # The same error on every rank (a bad row) leaves the group in step; a rank still
            # waiting, or a dead one, does not.
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.ping_timeout_s)
            if pending or not self._ranks_answer():
                cause = type(getattr(e, "cause", None) or e).__name__
                raise self._break(f"{method} failed on some ranks only ({cause})") from e
            raise

    # ---- health
    async def check_health(self) -> None:
        """Raises (Serve then replaces the replica) unless every rank answers and no round hangs."""
        if self.broken:
            raise TPGroupBroken(self.broken)
        started = self.round_started
        if started is not None and time.monotonic() - started > self.round_timeout_s:
            raise TimeoutError(f"a round has run for over {self.round_timeout_s} s")
        if self.workers and not await asyncio.to_thread(self._ranks_answer):
            raise TPGroupBroken(self.broken)

    async def healthy(self) -> bool:
        """check_health for callers (the ingress, after a failed round): True or the error."""
        await self.check_health()
        return True

    def _ranks_answer(self) -> bool:
        """Every rank answers a ping in time; if not, the group is broken."""
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=self.ping_timeout_s)
            return True
        except GetTimeoutError:
            self._break(f"a rank did not answer a ping within {self.ping_timeout_s} s")
        except RayActorError as e:
            self._break(f"a rank is dead: {type(e).__name__}")
        return False

    def _break(self, reason: str) -> TPGroupBroken:
        """Mark the group unusable and kill its ranks: a survivor may sit in a collective, and its
        bundle is better free for the replacement."""
        if not self.broken:
            self.broken = reason
            log.error("TP group broken: %s; killing its ranks", reason)
            kill_all(self.workers)
        return TPGroupBroken(f"TP group broken ({self.broken}); the replica is being replaced")

    # ---- introspection (tests, operators)
    def kv_capacity(self) -> int:
        """Tokens the KV cache holds (every rank has the same budget)."""
        if self.local is not None:
            return self.local.kv_capacity_tokens
        return ray.get(self.workers[0].kv_capacity.remote(), timeout=self.ping_timeout_s)

    async def rank_kv_capacities(self) -> list[int]:
        """The KV cache size of every rank (they must agree)."""
        if not self.workers:
            return [self.local.kv_capacity_tokens]
        refs = [w.kv_capacity.remote() for w in self.workers]
        return await asyncio.to_thread(ray.get, refs, timeout=self.ping_timeout_s)

    def tp_size(self) -> int:
        return max(1, len(self.workers))

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict:
        return {"rows": self.rows_verified, "pid": os.getpid()}

    async def rank_pids(self) -> list[int]:
        """The process of each rank (this replica's own for tp_size=1)."""
        if not self.workers:
            return [os.getpid()]
        refs = [w.pid.remote() for w in self.workers]
        return await asyncio.to_thread(ray.get, refs, timeout=self.ping_timeout_s)
