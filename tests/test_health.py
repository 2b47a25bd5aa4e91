"""health.Prober without Ray: a failed round alone never makes the service unhealthy; a part that
fails its probe does, until it answers again."""

import threading
import time

from deployments.ingress.health import Part, Prober


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
        [Part("target", lambda: Answer(lambda: True)), Part("drafter pool", lambda: Answer(up.is_set))], retry_s=0.01
    )
    assert until(prober.ready.is_set)
    up.clear()
    prober.round_failed("a rank died")
    assert until(lambda: prober.broken is not None) and "drafter pool" in prober.broken
    # the verdict is in (checking is cleared just after broken is set): waiting requests get their 503
    assert until(lambda: not prober.checking.is_set())
    up.set()
    assert until(lambda: prober.broken is None)
    prober.stop()


def test_a_poison_request_alone_fails_alone_and_the_next_one_is_answered():
    """The engine loop with a prober over sound parts: a request that breaks every round it is in
    (alone in its batch) fails with its error, the service stays ready, and the request after it
    is answered."""
    import queue

    from deployments.ingress.engine_loop import EngineLoop
    from fly_serve.build import build_engine

    engine = build_engine("tiny:0", "tiny:1", max_model_len=256, progress=lambda _: None)
    verify = engine.scorer.verify

    def poisoned(rows, drafts):
        if any(r.key.startswith("poison") for r in rows):
            raise ValueError("this row breaks the target's forward")
        return verify(rows, drafts)

    engine.scorer.verify = poisoned
    prober = Prober([Part("target", lambda: Answer(lambda: True))], retry_s=0.01)
    loop = EngineLoop(engine, on_round_failed=prober.round_failed)
    assert until(prober.ready.is_set)

    def run(request_id: str):
        updates = queue.SimpleQueue()
        loop.submit("hello hello", {"mode": "ar", "max_tokens": 6}, request_id, updates.put).result(timeout=30)
        while (u := updates.get(timeout=60)).finish_reason is None:
            pass
        return u

    failed = run("poison-1")
    assert failed.finish_reason == "error" and "breaks the target" in failed.error
    assert until(lambda: not prober.checking.is_set()) and prober.broken is None and loop.problem() is None
    answered = run("healthy-1")
    assert answered.finish_reason == "length" and answered.error is None
    loop.stop("test over")
    prober.stop()
