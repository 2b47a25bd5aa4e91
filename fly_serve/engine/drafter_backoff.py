"""Model drafters that just failed, left out of k auto's choice for a while.

A drafter call that raises (a replica gone, a pool being replaced) costs its round the call's
timeout, and its rows are drafted by prompt lookup instead (Engine._draft). Where k auto chooses a
row's drafter among several, a drafter that failed is left out of the choice for a backoff period:
`first_s` after a failure, doubled after each further failure without a success between, at most
`max_s`; the first call that succeeds clears it. Once the period is over the drafter is a
candidate again and is tried when k auto picks it. A request that names its drafter keeps it.

Seconds, not rounds: what the backoff waits for (a replica restarting) takes wall time, and rounds
run at any rate."""

import time


class DrafterBackoff:
    def __init__(self, first_s: float = 1.0, max_s: float = 60.0, clock=time.monotonic):
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff: need 0 < first_s <= max_s (got {first_s}, {max_s})")
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self._until: dict[str, float] = {}  # drafter -> the end of its backoff
        self._period: dict[str, float] = {}  # drafter -> its last backoff period

    def failed(self, name: str) -> None:
        period = min(2 * self._period[name], self.max_s) if name in self._period else self.first_s
        self._period[name], self._until[name] = period, self.clock() + period

    def succeeded(self, name: str) -> None:
        self._until.pop(name, None)
        self._period.pop(name, None)

    def period(self, name: str) -> float | None:
        """The drafter's last backoff period (None: it has not failed since its last success)."""
        return self._period.get(name)

    def down(self) -> set[str]:
        """The drafters in their backoff now."""
        if not self._until:
            return set()
        now = self.clock()
        return {name for name, until in self._until.items() if until > now}
