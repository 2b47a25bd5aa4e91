"""The ingress's round loop: one thread owns the Engine and runs rounds while there is work.

HTTP handlers never touch the Engine: they post submissions and aborts to an inbox, which the
thread drains between rounds (that is where requests join and leave). After each round the
thread hands every advanced request's new text to that request's sink. A bad request fails in
engine.add, alone; a failing round fails the requests of that round and the loop goes on.
"""
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

log = logging.getLogger("fly_serve.loop")


@dataclass
class Update:
    text: str  # new text since the last update
    finish_reason: str | None = None  # set on the last update only
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fly: dict = field(default_factory=dict)
    error: str | None = None  # the round failed (a replica died ...): the request is over


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.sinks: dict[str, callable] = {}
        self.max_batch_seen: dict[str, int] = {}  # request id -> largest batch it was part of
        self.rounds, self.largest_batch = 0, 0
        self.thread = threading.Thread(target=self._run, name="fly-engine-loop", daemon=True)
        self.thread.start()

    # ---- called from handlers (any thread)
    def submit(self, prompt, params: dict, request_id: str, sink) -> Future:
        """Future of the engine Request, or of the ValueError that rejected it."""
        fut = Future()
        self._post(("add", prompt, params, request_id, sink, fut))
        return fut

    def abort(self, request_id: str):
        self._post(("abort", request_id))

    def stats(self) -> dict:
        return {"rounds": self.rounds, "largest_batch": self.largest_batch,
                "running": len(self.engine.running), "waiting": len(self.engine.waiting),
                "last_round": dict(self.engine.last_round)}

    def _post(self, item):
        self.inbox.put(item)
        self.wake.set()

    # ---- the engine thread
    def _run(self):
        while True:
            self._drain()
            if not self.engine.has_work():
                self.wake.wait()
                self.wake.clear()
                continue
            try:
                advanced = self.engine.step()
            except Exception as e:  # a deployment failed: end this round's requests, keep serving
                log.exception("round failed")
                self._fail_running(f"{type(e).__name__}: {e}")
                continue
            self._count_round(advanced)
            self._publish(advanced)

    def _drain(self):
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                self._add(*item[1:])
            else:
                self._abort(item[1])

    def _add(self, prompt, params, request_id, sink, fut):
        try:
            req = self.engine.add(prompt, params, request_id=request_id)
        except ValueError as e:
            fut.set_exception(e)
            return
        self.sinks[req.id] = sink
        fut.set_result(req)

    def _abort(self, request_id):
        reqs = [r for r in list(self.engine.waiting) + self.engine.running if r.id == request_id]
        self.engine.abort(request_id)
        self._publish(reqs)

    def _count_round(self, advanced):
        last = self.engine.last_round
        self.rounds += 1
        self.largest_batch = max(self.largest_batch, last["batch_size"])
        for req in advanced:
            self.max_batch_seen[req.id] = max(self.max_batch_seen.get(req.id, 0), last["batch_size"])
        if self.metrics:
            self.metrics.round(last, sum(1 for r in advanced if r.params.mode != "ar"))

    def _publish(self, reqs):
        for req in reqs:
            seen = self.max_batch_seen.get(req.id, 0)
            sink = self.sinks.get(req.id)
            if sink is None:
                continue
            update = Update(req.delta())
            if req.finished:
                update.finish_reason = req.finish_reason
                update.prompt_tokens, update.completion_tokens = req.n_prompt, len(req.generated)
                update.fly = {**req.stats.as_dict(), "max_batch_size": seen}
                self._forget(req.id)
                if self.metrics:
                    self.metrics.done(req.finish_reason)
            sink(update)

    def _forget(self, request_id):
        self.sinks.pop(request_id, None)
        self.max_batch_seen.pop(request_id, None)

    def _fail_running(self, error: str):
        failed = list(self.engine.running)
        for req in failed:
            try:
                self.engine.abort(req.id)
            except Exception:  # releasing caches on a dead replica: nothing to keep
                log.exception("abort after a failed round")
        self.engine.running = [r for r in self.engine.running if not r.finished]
        for req in failed:
            sink = self.sinks.get(req.id)
            self._forget(req.id)
            if sink:
                sink(Update("", finish_reason="abort", error=error))
