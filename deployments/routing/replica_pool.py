"""Routing and scaling for pools of replicas that hold per-sequence state (KV caches).

Sticky groups. A caller splits its work into as many groups as the pool has live replicas and
tags each call with its group ("g<i>", carried as Serve's multiplexed model id). PinnedRouter
sends group i to the i-th live replica (replicas ordered by id), so each replica gets one call
per round, never several serial calls, and a row keeps meeting the replica that holds its KV
cache. When replicas come or go, the groups are re-dealt (rows carry all their tokens, so a row
that moves is only a cache miss on its new replica).

Rows are assigned to groups by rendezvous hashing: when the pool grows from n to n + 1 replicas,
only about 1/(n + 1) of the rows move.

Prefix affinity. A drafter replica holds a prefix cache (fly_serve/runtime/kv_cache.py), so a row is
hashed by its prompt's first AFFINITY_TOKENS tokens (a shorter prompt: by its key): requests
that share a system prompt or a conversation so far meet the replica that holds its blocks
(the rule of Ray Serve LLM's prefix-aware router, on tokens). Consistent hashing with bounded
loads (`pick_group`) keeps one hot prefix from taking every row: past (1 + LOAD_SLACK) x the
mean load (+ 1), a row falls to the next group in its own ranking (the least loaded in the limit).

The same router pins serving units: ingress replica r tags its target calls "g<r>", so each
ingress replica talks to its own target replica (no shared KV slot pool). Which unit an HTTP
request meets is unit_router.py's choice, by the same rendezvous + bounded-load rule
(`pick_bounded`) over the units' replica ids, keyed by the request's session id.

BusyPolicy scales the drafter pool on what a drafter really sees: the fraction of wall time its
model was busy (record_autoscaling_stats in drafter_replica.py), not ongoing requests, which the
round loop keeps at one call per replica however many users wait.
"""

import hashlib
import logging
import math
import threading
import time
from array import array
from collections.abc import Iterable

from ray import serve
from ray.serve.config import AutoscalingContext
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

log = logging.getLogger("fly_serve.replica_pool")

BUSY = "busy_fraction"  # the custom autoscaling metric a drafter replica reports


def group_tag(group: int) -> str:
    return f"g{group}"


def group_from_tag(tag: str | None) -> int | None:
    if tag and tag.startswith("g") and tag[1:].isdigit():
        return int(tag[1:])
    return None


def group_of(key: str, n_groups: int) -> int:
    """Rendezvous (highest random weight) hashing: stable across processes (blake2b, not the
    salted hash(); not crc32 either, whose linearity skews the weights), and growing n moves
    only the keys the new group wins."""
    return rendezvous(key, range(n_groups))[0]


def rendezvous(key: str, names: Iterable) -> list:
    """`names` (groups, replica ids) in the key's rendezvous order, best first: a name that
    leaves takes only its own keys with it, and one that comes wins only its share."""
    weight = {n: hashlib.blake2b(f"{n}:{key}".encode(), digest_size=8).digest() for n in names}
    return sorted(weight, key=weight.__getitem__, reverse=True)


def ranking(key: str, n_groups: int) -> list[int]:
    """The groups in the key's rendezvous order, best first (group_of is the first)."""
    return rendezvous(key, range(n_groups))


AFFINITY_TOKENS = 64  # four KV blocks of 16: past a chat template's fixed head
LOAD_SLACK = 0.5  # a group may hold up to 1.5x the mean rows before its prefix's rows spill over


def prefix_affinity(tokens: list[int], key: str) -> str:
    """What a row is routed by: its first AFFINITY_TOKENS tokens (the start of the prefix it may
    share with other requests), or its own key when the prompt is shorter."""
    if len(tokens) < AFFINITY_TOKENS:
        return key
    return "p" + hashlib.blake2b(array("q", tokens[:AFFINITY_TOKENS]).tobytes(), digest_size=8).hexdigest()


def pick_bounded(key: str, names: list, loads: dict, slack: float = LOAD_SLACK):
    """Consistent hashing with bounded loads: the first name in the key's rendezvous order that
    holds fewer than ceil((1 + slack) x the mean load, this one counted) + 1 (so that a few of
    one key's items stay together while the load is small); `loads`: items per name now."""
    bound = math.ceil((1 + slack) * (sum(loads.get(n, 0) for n in names) + 1) / len(names)) + 1
    return next(n for n in rendezvous(key, names) if loads.get(n, 0) < bound)


def pick_group(affinity: str, n_groups: int, loads: dict[int, int], slack: float = LOAD_SLACK) -> int:
    """A row's drafter group: pick_bounded over the groups; `loads`: rows per group now."""
    return pick_bounded(affinity, list(range(n_groups)), loads, slack)


def split(keys: list[str], n_groups: int) -> dict[int, list[int]]:
    """Indices of keys by group."""
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(group_of(key, n_groups), []).append(i)
    return groups


class PinnedRouter(RequestRouter):
    """Group i goes to the i-th live replica (by replica id); untagged calls (health probes,
    reports) and calls whose replica is not available go to any other replica. Not FIFOMixin:
    with it a replica chosen for one call goes to the oldest call waiting, another group's when
    a queue-length probe makes the routing tasks finish out of order."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        group = group_from_tag(pending_request.metadata.multiplexed_model_id) if pending_request else None
        live = sorted(self.curr_replicas.values(), key=lambda r: r.replica_id.unique_id)
        if group is None or not live:
            return [candidate_replicas]
        pinned = live[group % len(live)].replica_id
        first = [r for r in candidate_replicas if r.replica_id == pinned]
        return [first, [r for r in candidate_replicas if r.replica_id != pinned]] if first else [candidate_replicas]


def unit_rank(ctx) -> int:
    """This replica's rank in its deployment (0..n-1), from Serve's replica context."""
    rank = getattr(ctx, "rank", 0)
    return int(getattr(rank, "rank", rank) or 0)


class LiveReplicas:
    """How many replicas of a deployment are running, from Serve's status, asked at most every
    `ttl_s` (the answer sizes the groups of every round; the controller is not asked per round).

    The round never waits for the answer: it gets the last one, and a thread of its own asks
    Serve's controller. While the controller is gone (its head node died: until the head is back
    and Serve has recovered, minutes at worst) that ask waits, and rounds go on with the count
    they had."""

    def __init__(self, app_name: str, deployment: str, ttl_s: float = 2.0, ask=None):
        self.app_name, self.deployment, self.ttl_s = app_name, deployment, ttl_s
        self.ask = ask or self._running
        self._n, self._at = 1, -math.inf
        self._asking = False
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            if not self._asking and time.monotonic() - self._at > self.ttl_s:
                self._asking = True
                threading.Thread(target=self._refresh, name=f"live-{self.deployment}", daemon=True).start()
            return self._n

    @property
    def last(self) -> int:
        """The count rounds get now, without asking for a new one (the service's stats)."""
        return self._n

    def _refresh(self) -> None:
        try:
            n = max(1, int(self.ask()))
        except Exception as e:  # keep the last answer: routing stays correct either way
            log.warning("replica count of %s unknown (%s)", self.deployment, type(e).__name__)
            n = None
        with self._lock:
            self._n = self._n if n is None else n
            self._at, self._asking = time.monotonic(), False

    def _running(self) -> int:
        return serve.status().applications[self.app_name].deployments[self.deployment].replica_states.get("RUNNING", 0)


class BusyPolicy:
    """Replicas so that each is busy about `target` of its time: desired = total busy / target.
    Serve applies min/max_replicas, up/downscale delays and factors around this."""

    def __init__(self, target: float = 0.6):
        if not 0 < target <= 1:
            raise ValueError(f"target: must be in (0, 1], got {target}")
        self.target = target

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict]:
        busy = (ctx.aggregated_metrics or {}).get(BUSY) or {}
        if not busy:  # no reports yet (a fresh deployment): keep what there is
            return ctx.target_num_replicas, {}
        return desired_replicas(list(busy.values()), self.target), {}


def desired_replicas(busy_fractions: list[float], target: float) -> float:
    """Total busy time over the pool, in replicas, divided by the busy fraction wanted of each."""
    return max(1.0, sum(min(1.0, max(0.0, b)) for b in busy_fractions) / target)
