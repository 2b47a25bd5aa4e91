"""How many requests a replica takes: its own bound (Slots) and the Serve options that let ours
answer first."""

import threading

# Requests a replica takes beyond those in flight in the engine: the ones answered at once (a 503,
# a 4xx, /healthz, stats), so that Serve passes them on instead of queueing or shedding them.
ANSWERED_AT_ONCE = 32


def serve_limits(max_batch: int, max_waiting: int) -> dict:
    """The ingress deployment's Serve options for a profile. Serve's own shedding answers a
    plain-text 503; ours answers the OpenAI error body with Retry-After. So Serve never sheds
    (no queue limit: a queued request is a connection the client holds, and it reaches the
    handler, and its 503, within milliseconds), and a replica takes every request ours may admit
    plus room for those it answers at once. That holds because a request reaches the replica with
    its body read (proxy_guard.py): a client that sends its body slowly waits in the proxy, not in
    one of these places."""
    return {"max_ongoing_requests": max_batch + max_waiting + ANSWERED_AT_ONCE, "max_queued_requests": -1}


class Slots:
    """The requests in flight in this replica, from admission to their last byte, at most
    `capacity` (max_batch running + max_waiting queued): past that a request is answered 503 at
    once instead of queueing without end. Keyed by request id, so that giving back twice (a
    stream's end, then its response's finalizer) gives back once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: set[str] = set()
        self._lock = threading.Lock()  # the finalizer may run on any thread

    def take(self, request_id: str) -> bool:
        with self._lock:
            if len(self._held) >= self.capacity:
                return False
            self._held.add(request_id)
            return True

    def give(self, request_id: str) -> bool:
        """True if it was held (and is given back now)."""
        with self._lock:
            if request_id not in self._held:
                return False
            self._held.remove(request_id)
            return True

    def __len__(self) -> int:
        return len(self._held)
