"""The ingress's round loop: one thread owns the Engine and runs rounds while there is work.

HTTP handlers never touch the Engine: they post submissions and aborts to an inbox, which the
thread drains between rounds (that is where requests join and leave). After each round the
thread hands every advanced request's new text to that request's sink. Whatever one inbox item
does (a bad request, a client that already left, a release on a dead replica) is handled alone;
a failing round fails the requests of that round and the loop goes on.
"""

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from fly_serve.contracts import RoundResult
from fly_serve.engine import Engine, Request
from fly_serve.params import Params

log = logging.getLogger("fly_serve.engine_loop")


@dataclass
class Update:
    text: str  # new text since the last update
    finish_reason: str | None = None  # set on the last update only
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fly: dict = field(default_factory=dict)
    error: str | None = None  # the request failed (a replica died ...): it is over


@dataclass
class _Submit:
    prompt: str | list[int]
    params: Params | dict
    request_id: str
    sink: Callable[[Update], None]
    future: Future


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, engine: Engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.sinks: dict[str, Callable[[Update], None]] = {}
        self.max_batch_seen: dict[str, int] = {}  # request id -> largest batch it was part of
        self.rounds, self.largest_batch = 0, 0
        self.last_round = RoundResult()
        self.thread = threading.Thread(target=self._run, name="fly-engine-loop", daemon=True)
        self.thread.start()

    # ---- called from handlers (any thread)
    def submit(self, prompt, params: Params | dict, request_id: str, sink) -> Future:
        """Future of the engine Request, or of the ParamError that rejected it."""
        fut = Future()
        self._post(_Submit(prompt, params, request_id, sink, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    def snapshot(self) -> dict:
        r = self.last_round
        return {
            "rounds": self.rounds,
            "largest_batch": self.largest_batch,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "last_round": {
                "batch_size": r.batch_size,
                "draft_s": r.draft_s,
                "verify_s": r.verify_s,
                "decide_s": r.decide_s,
                "drafted": r.drafted,
                "accepted": r.accepted,
                "loosely_accepted": r.loosely_accepted,
                "emitted": r.emitted,
            },
        }

    def _post(self, item) -> None:
        self.inbox.put(item)
        self.wake.set()

    # ---- the engine thread
    def _run(self) -> None:
        while True:
            self._drain()
            if not self.engine.has_work():
                self.wake.wait()
                self.wake.clear()
                continue
            try:
                result = self.engine.step()
            except Exception as e:  # a deployment failed: end this round's requests, keep serving
                log.exception("round failed")
                self._fail_running(f"{type(e).__name__}: {e}")
                continue
            self._count_round(result)
            self._publish(result.advanced)

    def _drain(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if isinstance(item, _Submit):
                    self._add(item)
                else:
                    self._abort(item.request_id)
            except Exception:  # one item never stops the loop
                log.exception("inbox item %r failed", item)

    def _add(self, s: _Submit) -> None:
        if not s.future.set_running_or_notify_cancel():
            return  # the client left before its request was admitted
        try:
            req = self.engine.add(s.prompt, s.params, request_id=s.request_id)
        except Exception as e:  # a ParamError is the client's 400; anything else its 500
            s.future.set_exception(e)
            return
        self.sinks[req.id] = s.sink
        s.future.set_result(req)

    def _abort(self, request_id: str) -> None:
        reqs = [r for r in list(self.engine.waiting) + self.engine.running if r.id == request_id]
        try:
            self.engine.abort(request_id)
        finally:
            self._publish(reqs)

    def _count_round(self, result: RoundResult) -> None:
        self.rounds += 1
        self.last_round = result
        self.largest_batch = max(self.largest_batch, result.batch_size)
        for req in result.advanced:
            self.max_batch_seen[req.id] = max(self.max_batch_seen.get(req.id, 0), result.batch_size)
        if self.metrics:
            self.metrics.round(result)

    def _publish(self, reqs: list[Request]) -> None:
        for req in reqs:
            sink = self.sinks.get(req.id)
            if sink is None:
                continue
            update = Update(req.delta())
            if req.finished:
                update.finish_reason, update.error = req.finish_reason, req.error
                update.prompt_tokens, update.completion_tokens = req.n_prompt, len(req.generated)
                update.fly = {**req.stats.as_dict(), "max_batch_size": self.max_batch_seen.get(req.id, 0)}
                self._forget(req.id)
                if self.metrics:
                    self.metrics.done(req.finish_reason)
            sink(update)

    def _forget(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        self.max_batch_seen.pop(request_id, None)

    def _fail_running(self, error: str) -> None:
        failed = list(self.engine.running)
        try:
            self.engine.fail_running(error)
        except Exception:  # releasing caches on a dead replica: the batch is already retired
            log.exception("release after a failed round")
        self._publish(failed)
