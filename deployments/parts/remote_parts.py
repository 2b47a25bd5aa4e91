"""The engine's parts as calls to deployments: RemoteScorer satisfies contracts.Scorer,
RemoteDrafter contracts.Drafter, so the ingress's Engine runs its rounds
unchanged while drafting and verification run in their own replicas. Called from the engine
thread (not an event loop), so the blocking `.result()` is fine there.

Every call waits at most `timeout_s`: a replica that hangs or is gone makes the call raise
RemoteTimeout, the engine's round fails (the engine retries it, then isolates the rows, and a
drafter failure falls back to prompt lookup), and no request waits forever. Releases (freeing a
finished sequence's KV cache) are sent and not waited for on the engine thread (`Releases`: a
thread of their own confirms them, each within RELEASE_TIMEOUT_S, and logs what failed); they
never raise: a cache on a dead or replaced replica is gone anyway, and a live replica's LRU
reclaims what a lost release leaves.
"""

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict

from deployments.parts.row_history import RowSender, rows_unknown
from deployments.profiles.app_args import DEFAULT_CALL_TIMEOUT_S
from deployments.routing.replica_pool import group_of, group_tag, pick_group, prefix_affinity
from fly_serve.contracts import Drafts, Row, Verdict

log = logging.getLogger("fly_serve.remote_parts")

RELEASE_TIMEOUT_S = 5.0  # at most, for a release's answer (on the Releases thread, never the engine's)
MAX_PENDING_RELEASES = 256  # release calls not yet answered; past that a new one is cancelled (LRU reclaims)
MAX_PINS = 4096  # rows whose drafter group is remembered (running ones; a lost release ages out)


class RemoteTimeout(TimeoutError):
    """A deployment did not answer within the timeout."""


def wait(response, timeout_s: float, what: str):
    """The result of a handle call, or RemoteTimeout after timeout_s; a timed-out call is
    cancelled so that it does not keep its place in the replica's queue."""
    try:
        return response.result(timeout_s=max(0.0, timeout_s))
    except TimeoutError:  # Serve's own and ray.exceptions.GetTimeoutError
        _cancel(response)
        raise RemoteTimeout(f"{what} did not answer within {timeout_s:g} s") from None


class Releases:
    """Release calls confirmed off the engine thread. The engine thread sends them (so a release
    goes before the next round's calls) and hands them here; one thread of this process waits for
    each answer until RELEASE_TIMEOUT_S after it was sent, cancels a call that did not answer by
    then (it keeps no place in a replica's queue) and logs what failed. With one drafter pool's
    replica gone, every retire would otherwise wait out the timeout on the engine thread. At most
    MAX_PENDING_RELEASES calls wait; past that a new one is cancelled at once: a lost release
    costs a replica's LRU, never memory without end."""

    def __init__(self, max_pending: int = MAX_PENDING_RELEASES):
        self.pending: queue.Queue = queue.Queue(max_pending)
        self.dropped = 0  # calls cancelled because too many were waiting (logged)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def confirm(self, responses: list, timeout_s: float, what: str) -> None:
        """Wait for these sent calls on the releases thread, each until timeout_s from now."""
        deadline = time.monotonic() + timeout_s
        self._start()
        for response in responses:
            try:
                self.pending.put_nowait((deadline, response, what))
            except queue.Full:
                self.dropped += 1
                _cancel(response)
                log.warning(
                    "%s.release dropped (%d waiting); the replica's LRU reclaims those slots",
                    what,
                    self.pending.maxsize,
                )

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fly-releases", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            deadline, response, what = self.pending.get()
            try:
                wait(response, deadline - time.monotonic(), f"{what}.release")
            except Exception as e:
                log.warning("%s.release failed (%s); the replica's LRU reclaims those slots", what, type(e).__name__)


def _cancel(response) -> None:
    try:
        response.cancel()
    except Exception:  # best effort: the replica may be gone
        pass


RELEASES = Releases()  # the process's one releases thread, shared by every remote part


class RemoteScorer:
    def __init__(self, handle, vocab_size: int, timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.handle, self.vocab_size, self.timeout_s = handle, vocab_size, timeout_s
        self._kv_capacity: int | None = None
        self.rows = RowSender()  # each row's tokens go once (every TP rank keeps its history)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The target replica's KV cache size, asked once (the engine admits requests within it)."""
        if self._kv_capacity is None:
            try:
                self._kv_capacity = wait(self.handle.kv_capacity.remote(), self.timeout_s, "target.kv_capacity")
            except Exception:
                return None  # not known yet: the replica's own cache still refuses what cannot fit
        return self._kv_capacity

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        try:
            verdict = wait(self.handle.verify.remote(self.rows.compact(rows), drafts), self.timeout_s, "target.verify")
        except Exception as e:
            self.rows.forget([r.key for r in rows])
            if not rows_unknown(e):
                raise
            # a new or restarted replica: the rows whole, once
            verdict = wait(self.handle.verify.remote(rows, drafts), self.timeout_s, "target.verify")
        self.rows.sent(rows)
        return verdict

    def release(self, keys: list[str]) -> None:
        self.rows.forget(keys)
        RELEASES.confirm([self.handle.release.remote(keys)], min(self.timeout_s, RELEASE_TIMEOUT_S), "target")


class RemoteDrafter:
    """Splits a round's rows into one group per live drafter replica (at most `max_groups`);
    each group is one call, tagged "g<i>" so that replica_pool.PinnedRouter sends it to the
    replica that drafted those rows before (and holds their KV caches). The group calls run
    concurrently, under one deadline: a round's drafting takes as long as its largest group.
    A row's group is picked once, by its prompt's prefix (replica_pool.pick_group: where its
    prefix is likely cached, within a bound on load), and kept until it is released or the
    number of groups changes.

    `live` returns the number of live replicas (replica_pool.LiveReplicas); without it, one group.
    `grammars`: whether the pool's replicas draft under a row's grammar (build.drafts_under_grammar:
    a drafter of another tokenizer does not)."""

    def __init__(
        self, handle, max_groups: int = 1, timeout_s: float = DEFAULT_CALL_TIMEOUT_S, live=None, grammars: bool = True
    ):
        self.handle, self.max_groups, self.timeout_s = handle, max_groups, timeout_s
        self.live = live or (lambda: 1)
        self.grammars = grammars
        # Each row's tokens go once. A row that moves to another replica (the pool changed) is
        # refused there as unknown and sent whole: tokens only grow, so any replica's history of
        # a row is a prefix of it.
        self.rows = RowSender()
        self.pins: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (groups then, group)

    def _groups(self) -> int:
        return max(1, min(self.max_groups, self.live()))

    def _for(self, group: int):
        return self.handle.options(multiplexed_model_id=group_tag(group))

    def propose(self, rows: list[Row]) -> Drafts:
        try:
            out = self._propose(rows)
        except Exception:
            self.rows.forget([r.key for r in rows])
            raise
        self.rows.sent(rows)
        return out

    def assign(self, rows: list[Row]) -> dict[int, list[int]]:
        """Indices of the rows by group: a pinned row keeps its group while the number of groups
        stays; a new one is picked by its prefix among the rows pinned now."""
        n = self._groups()
        loads = Counter(g for m, g in self.pins.values() if m == n)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            pin = self.pins.get(r.key)
            if pin is None or pin[0] != n:
                pin = (n, pick_group(prefix_affinity(r.tokens, r.key), n, loads))
                loads[pin[1]] += 1
                self.pins[r.key] = pin
            self.pins.move_to_end(r.key)
            groups.setdefault(pin[1], []).append(i)
        while len(self.pins) > MAX_PINS:  # a lost release costs a pin, never memory without end
            self.pins.popitem(last=False)
        return groups

    def _propose(self, rows: list[Row]) -> Drafts:
        groups = self.assign(rows)
        compact = self.rows.compact(rows)
        calls = {g: self._for(g).propose.remote([compact[i] for i in idx]) for g, idx in groups.items()}
        deadline = time.monotonic() + self.timeout_s
        out = Drafts.empty(len(rows))
        for g, idx in groups.items():
            try:
                got = wait(calls[g], deadline - time.monotonic(), "drafter.propose")
            except Exception as e:
                if not rows_unknown(e):
                    raise
                whole = self._for(g).propose.remote([rows[i] for i in idx])  # a replica new to these rows
                got = wait(whole, deadline - time.monotonic(), "drafter.propose")
            out.forwards = max(out.forwards, got.forwards)  # the groups draft concurrently
            out.compute_s = max(out.compute_s or 0.0, got.compute_s or 0.0)
            for j, i in enumerate(idx):
                out.tokens[i], out.q[i] = got.tokens[j], got.q[j]
            if got.guesses is not None:  # draft-ahead rows (Row.peek): the drafter's own next tokens
                out.guesses = out.guesses or [None] * len(rows)
                for j, i in enumerate(idx):
                    out.guesses[i] = got.guesses[j]
            if got.row_forwards is not None:  # k auto's per-row cost (MLA drafts some rows for free)
                out.row_forwards = out.row_forwards or [0] * len(rows)
                for j, i in enumerate(idx):
                    out.row_forwards[i] = got.row_forwards[j]
            if got.prefix_hit_tokens is not None:
                out.prefix_hit_tokens = out.prefix_hit_tokens or [0] * len(rows)
                for j, i in enumerate(idx):
                    out.prefix_hit_tokens[i] = got.prefix_hit_tokens[j]
        return out

    def release(self, keys: list[str]) -> None:
        # The pool may have changed since the rows were drafted: a release that misses leaves
        # the slot to the replica's LRU.
        self.rows.forget(keys)
        groups: dict[int, list[int]] = {}
        n = self._groups()
        for i, key in enumerate(keys):
            pin = self.pins.pop(key, None)
            groups.setdefault(pin[1] if pin and pin[0] == n else group_of(key, n), []).append(i)
        calls = [self._for(g).release.remote([keys[i] for i in idx]) for g, idx in groups.items()]
        RELEASES.confirm(calls, min(self.timeout_s, RELEASE_TIMEOUT_S), "drafter")

    def share_sources(self, sources: dict) -> None:
        pass  # the engine's sources live in this process; a drafter replica keeps its own prompt lookup

    def share_grammars(self, grammars) -> bool:
        return self.grammars  # each replica drafts under a row's grammar with its own (build.grammars_for)
