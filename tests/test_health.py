"""health.Prober without Ray: a failed round alone never makes the service unhealthy; a part that
fails its probe does, until it answers again."""

import threading
import time

from deployments.health import Part, Prober


class Answer:
    def __init__(self, ok):
        self.ok = ok

    def result(self, timeout_s=None):
        if not self.ok():
            raise RuntimeError("the part is down")
        return True

    def cancel(self):
        pass


def until(condition, timeout_s=5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_failed_round_with_sound_parts_leaves_the_service_ready():
    probes = []
    prober = Prober([Part("target", lambda: probes.append(1) or Answer(lambda: True))], retry_s=0.01)
    assert until(prober.ready.is_set)
    prober.round_failed("a poison row")
    assert until(lambda: not prober.checking.is_set()) and len(probes) == 2  # probed once more
    assert prober.broken is None
    prober.stop()


def test_a_part_that_fails_its_probe_makes_it_unhealthy_until_it_answers():
    up = threading.Event()
    up.set()
    prober = Prober(
        [Part("target", lambda: Answer(lambda: True)), Part("drafter pool", lambda: Answer(up.is_set))],
        retry_s=0.01,
    )
    assert until(prober.ready.is_set)
    up.clear()
    prober.round_failed("a rank died")
    assert until(lambda: prober.broken is not None) and "drafter pool" in prober.broken
    assert not prober.checking.is_set()  # the verdict is in: waiting requests get their 503
    up.set()
    assert until(lambda: prober.broken is None)
    prober.stop()
