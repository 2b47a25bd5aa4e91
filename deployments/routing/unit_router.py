"""Which serving unit an HTTP request goes to: the one whose target holds its conversation.

A unit is one ingress replica (its engine loop) and its own target replica (ingress.py tags its
target calls "g<rank>"), so a prefix is cached in one unit only. Serve's proxy picks the ingress
replica through the ingress deployment's request router, and this is that router.

What a router sees of an HTTP request (Ray Serve 2.60, _private/proxy.py): it is chosen BEFORE the
body is read. PendingRequest.args holds the pickled ASGI scope (path, headers), and the body is
pulled from the proxy by the replica afterwards; RequestMetadata carries the route and the
`session_id`, which the proxy copies from the `X-Session-Id` header (Serve's own session
stickiness header; RAY_SERVE_SESSION_ID_HEADER_KEY renames it). So the router pins by the session
id the client sends; a field of the body (OpenAI's `user`, the messages' first tokens) would need
the body read before routing: another hop in front of the units (as in Ray Serve LLM, whose
prefix-aware router runs on the handle from its OpenAI ingress, after that has parsed the body),
which every request would pay for a cache hit only some get.

The rule is the drafter pool's (replica_pool.pick_bounded): rendezvous hashing of the session id
over the live units' replica ids (a unit that goes or comes moves only its own share of sessions),
with bounded loads (past (1 + LOAD_SLACK) x the mean ongoing requests + 1 the next unit in the
session's order takes it). A unit that says it is not ready (loading, draining, unhealthy: its
`record_routing_stats`) is passed over while another is ready. Without a session id: Serve's
usual choice, the less loaded of two random ready units.
"""

import random
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .replica_pool import LOAD_SLACK, pick_bounded, rendezvous

SESSION_HEADER = "X-Session-Id"
READY = "ready"
STATUS = "status"  # the key of the routing stats an ingress replica reports
ROUTING_STATS_PERIOD_S = 2.0  # how stale a unit's readiness may be at the router


@dataclass(frozen=True)
class Unit:
    load: int  # requests ongoing at the unit, as the router last knew
    ready: bool


def units_from(seen: dict[str, tuple[int | None, dict]]) -> dict[str, Unit]:
    """Units as the router knows them: name -> (ongoing requests, None when the proxy's view is
    stale; the routing stats the unit last reported). A unit that has not reported yet is not
    ready (it may still be loading: sessions would wait on it and get a 503); a stale load counts
    as the mean of the known ones (as 0 it would draw the sessions of a busy unit)."""
    known = [load for load, _ in seen.values() if load is not None]
    mean = round(sum(known) / len(known)) if known else 0
    return {
        name: Unit(mean if load is None else load, stats.get(STATUS) == READY) for name, (load, stats) in seen.items()
    }


def route(session: str, units: dict[str, Unit], slack: float = LOAD_SLACK, rng=random) -> list[list[str]]:
    """Ranks of unit names (replica ids), best first, for Serve to try in order (within a rank
    it takes the least loaded unit that accepts). A session: its bounded-load pick, then the
    others in its rendezvous order, one a rank. None: two random units in one rank."""
    eligible = sorted(n for n, u in units.items() if u.ready) or sorted(units)  # none ready: they answer 503
    if not eligible:
        return []
    if not session:
        return [rng.sample(eligible, min(2, len(eligible)))]
    first = pick_bounded(session, eligible, {n: units[n].load for n in eligible}, slack)
    return [[first]] + [[n] for n in rendezvous(session, eligible) if n != first]


class UnitRouter(RequestRouter):
    """The ingress deployment's request router (route() over the live replicas). Not FIFOMixin:
    a replica chosen for one request must go to that request, not to the oldest one waiting."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = self.replica_queue_len_cache
        units = units_from({name: (loads.get(r.replica_id), r.routing_stats or {}) for name, r in by_name.items()})
        session = ""
        if pending_request is not None:
            session = pending_request.metadata.session_id
            pending_request.routing_context.should_backoff = True  # all full: back off, do not spin
        return [[by_name[n] for n in rank] for rank in route(session, units)]


def router_config() -> dict:
    """The ingress deployment's request_router_config."""
    return {"request_router_class": UnitRouter, "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
