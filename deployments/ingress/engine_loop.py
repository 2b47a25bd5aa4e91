"""The ingress's round loop: one thread owns the Engine and runs rounds while there is work.

The thread is also the ingress process's torch thread: given a function that builds the Engine,
it loads the models there, and `call` runs other model work there between rounds (k auto's
calibration), so the process has one OpenMP team (deployments/parts/threads.py says why that matters).

HTTP handlers never touch the Engine: they post submissions and aborts to an inbox, which the
thread drains between rounds (that is where requests join and leave). After each round the
thread hands every advanced request's new text to that request's sink. Whatever one inbox item
does (a bad request, a client that already left, a release on a dead replica) is handled alone;
a failing round fails the requests of that round and the loop goes on; an unexpected fault in
the loop's own bookkeeping is logged and the loop goes on too. `problem()` says when the loop
cannot be trusted any more (its thread ended, or a round has run far too long): the ingress's
health check turns that into a replica replacement, and waiting handlers into an error answer.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from fly_serve.contracts import RoundResult
from fly_serve.engine.engine import Engine, Request
from fly_serve.engine.params import Params

log = logging.getLogger("fly_serve.engine_loop")

FAULT_BACKOFF_S = 0.5  # after an unexpected fault in the loop: a fault that repeats must not spin a core


@dataclass
class Update:
    text: str  # new text since the last update
    finish_reason: str | None = None  # set on the last update only
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fly: dict = field(default_factory=dict)
    error: str | None = None  # the request failed (a replica died ...): it is over. Internal detail, for the log
    # the request's own field that ended it (a grammar with no way on past the pre-check): the
    # client's error, its `error` the reason to tell the client
    error_param: str | None = None


# A round's timeline, in order: the loop's own time before it (inbox, admissions), the drafter call
# and what the drafter computed of it, the target call and its compute, the decision, the hand-out
# of text to the requests. With draft-ahead (fly_serve/drafting/draft_ahead.py) the drafter's call for the
# next round runs during verify_call ("ahead_call"), and each side may wait for the other:
# "verify_wait" the drafter idle until the verdict, "draft_wait" the verdict idle until the ahead
# drafts (only draft_wait adds to the round).
TIMELINE = (
    "ingress_wait",
    "draft_call",
    "draft_compute",
    "verify_call",
    "verify_compute",
    "ahead_call",
    "verify_wait",
    "draft_wait",
    "decide",
    "publish",
)


def round_timeline(r: RoundResult) -> dict[str, float]:
    seconds = (
        r.ingress_wait_s,
        r.draft_s,
        r.draft_compute_s,
        r.verify_s,
        r.verify_compute_s,
        r.ahead_s,
        r.verify_wait_s,
        r.draft_wait_s,
        r.decide_s,
        r.publish_s,
    )
    return dict(zip(TIMELINE, seconds))


@dataclass
class _Submit:
    prompt: str | list[int]
    params: Params | dict
    request_id: str
    sink: Callable[[Update], None]
    future: Future
    arrival: float  # time.monotonic() when the request arrived, for the time to first token
    messages: list[dict] | None = None  # a chat request's conversation (a drafter of another tokenizer renders it)
    matcher: object = None  # its grammar's matcher, compiled by check_grammar (grammar.Grammars.handing)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[], object]
    future: Future


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None


class EngineLoop:
    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        metrics=None,
        stuck_round_s: float = float("inf"),
        on_round_failed: Callable[[str], None] | None = None,
    ):
        """engine: the Engine, or a function that builds it on the loop's thread (the constructor
        waits for it and raises what it raised). on_round_failed(reason): told when a round fails
        (from the engine thread; must not block)."""
        self.metrics = metrics
        self.on_round_failed = on_round_failed
        self.stuck_round_s = stuck_round_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.sinks: dict[str, Callable[[Update], None]] = {}
        self.timing: dict[str, _Timing] = {}
        self.max_batch_seen: dict[str, int] = {}  # request id -> largest batch it was part of
        self.rounds, self.largest_batch = 0, 0
        self.finished: dict[str, int] = {}  # finish_reason -> requests (stop, length, abort, error)
        self.last_round = RoundResult()
        self.by_drafter: dict[str, list[int]] = {}  # per drafter (or model-free source): [drafted, kept] since start
        self.round_started: float | None = None  # time.monotonic() while a round runs
        self.ready_at = time.monotonic()  # when the loop last woke or ended a round (ingress wait starts)
        self.timeline = {phase: 0.0 for phase in TIMELINE}  # seconds by phase, all rounds since start
        self.stop_reason: str | None = None  # set by stop(): the loop ends its requests and exits
        self._closed, self._calls_lock = False, threading.Lock()  # closed: no call() runs any more
        built: Future = Future()
        if isinstance(engine, Engine):
            built.set_result(engine)
            engine = None
        self.thread = threading.Thread(target=self._run, args=(engine, built), name="fly-engine-loop", daemon=True)
        self.thread.start()
        self.engine: Engine = built.result()

    # ---- called from handlers (any thread)
    def submit(
        self,
        prompt,
        params: Params | dict,
        request_id: str,
        sink,
        arrival: float | None = None,
        messages: list[dict] | None = None,
        matcher=None,
    ) -> Future:
        """Future of the engine Request, or of the ParamError that rejected it. messages: a chat
        request's conversation, which the prompt renders (Engine.add); matcher: its grammar's,
        from check_grammar (the engine thread then compiles nothing)."""
        fut = Future()
        arrival = time.monotonic() if arrival is None else arrival
        self._post(_Submit(prompt, params, request_id, sink, fut, arrival, messages, matcher))
        return fut

    def check_grammar(self, params: dict):
        """The matcher of a request's structured output (None: unconstrained), or ParamError for
        one that admission would refuse or that the grammar library cannot follow along its first
        tokens (grammar.Grammars.check). Runs on the caller's thread (a worker thread of the
        ingress): compiling costs the engine thread nothing, and the matcher goes to it with the
        request (submit). Reads only what does not change once the engine is built (its
        defaults, its grammar side)."""
        return self.engine.grammars.check(self.engine.defaults.merged(params))

    def abort(self, request_id: str) -> None:
        """Idempotent: aborting a finished or unknown request does nothing."""
        self._post(_Abort(request_id))

    def call(self, fn: Callable[[], object]) -> Future:
        """Future of fn() run on the loop's thread between rounds (model work: threads.py)."""
        fut = Future()
        if threading.current_thread() is self.thread:  # already here: queued, it would wait for itself
            self._call(_Call(fn, fut))
            return fut
        with self._calls_lock:  # posted before the loop closes, so its last drain answers it
            if self._closed:
                fut.set_exception(RuntimeError("the engine loop has stopped"))
            else:
                self._post(_Call(fn, fut))
        return fut

    def stop(self, reason: str) -> None:
        """Ends every request still here with an error (reason goes to the log) and ends the thread
        after the round in progress."""
        self.stop_reason = reason
        self.wake.set()

    def problem(self) -> str | None:
        """Why this loop cannot serve (None: it can): its thread has ended, or a round has run
        longer than stuck_round_s (a hang that the remote calls' own timeouts did not catch)."""
        if not self.thread.is_alive():
            return "the engine loop has stopped"
        started = self.round_started
        if started is not None and time.monotonic() - started > self.stuck_round_s:
            return f"a round has run for over {self.stuck_round_s:g} s"
        return None

    def snapshot(self) -> dict:
        r, k_auto = self.last_round, self.engine.policy.report()
        return {
            "rounds": self.rounds,
            "largest_batch": self.largest_batch,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            "finished": dict(self.finished),
            # k auto under load: the drafter and the width priced as rounds of 2+ rows measure them
            # (fly_serve/k_auto/measured_cost.py); probes: rows k auto made draft to measure them again
            "k_auto_under_load": k_auto["under_load"],
            "k_auto_probes": k_auto["probes"],
            "draft_sources": self.engine.draft_sources(),
            # the model drafters by name (the first the default), and per drafter (or model-free
            # source) the tokens it drafted and the drafts kept since start
            "drafters": list(self.engine.drafter_names),
            "by_drafter": {name: {"drafted": d, "kept": k} for name, (d, k) in sorted(self.by_drafter.items())},
            # mean seconds per round by phase; call minus compute is transport
            "timeline": {phase: s / max(self.rounds, 1) for phase, s in self.timeline.items()},
            "last_round": {
                "batch_size": r.batch_size,
                "draft_s": r.draft_s,
                "verify_s": r.verify_s,
                "decide_s": r.decide_s,
                "timeline": round_timeline(r),
                "drafted": r.drafted,
                "accepted": r.accepted,
                "loosely_accepted": r.loosely_accepted,
                "emitted": r.emitted,
                "ahead_hits": r.ahead_hits,
                "ahead_misses": r.ahead_misses,
                "ahead_dropped": r.ahead_dropped,
            },
        }

    def _post(self, item) -> None:
        self.inbox.put(item)
        self.wake.set()

    # ---- the engine thread
    def _run(self, build: Callable[[], Engine] | None, built: Future) -> None:
        if build is not None:
            try:
                built.set_result(build())
            except BaseException as e:  # the constructor raises it
                built.set_exception(e)
                with self._calls_lock:
                    self._closed = True
                return
        self.engine = built.result()
        try:
            while self.stop_reason is None:
                try:
                    self._iterate()
                except Exception:  # bookkeeping, metrics, a sink: never let it end the loop
                    log.exception("engine loop iteration failed; continuing")
                    time.sleep(FAULT_BACKOFF_S)
        finally:  # even a BaseException: no call() may wait for a loop that is gone
            with self._calls_lock:
                self._closed = True
        self._shutdown(self.stop_reason)

    def _iterate(self) -> None:
        self._drain()
        self._report_queue()
        if not self.engine.has_work():
            self.wake.wait()
            self.wake.clear()
            self.ready_at = time.monotonic()
            return
        self.round_started = time.monotonic()
        ingress_wait_s = self.round_started - self.ready_at
        try:
            result = self.engine.step()
        except Exception as e:  # the engine retries and isolates itself; this is what is left
            log.exception("round failed")
            reason = f"{type(e).__name__}: {e}"
            self._round_failed(reason)
            self._fail_running(reason)
            return
        finally:
            self.round_started = None
        if result.failed:
            # Rows that failed even after the engine's retry and bisection may have failed for
            # their own reasons (a poison request) or because a part is down: the listener finds
            # out which (health.Prober), told before the failed requests are answered.
            self._round_failed(result.failed[0].error or "the round failed")
        t0 = time.monotonic()
        self._publish(result.advanced)
        self.ready_at = time.monotonic()
        result.ingress_wait_s, result.publish_s = ingress_wait_s, self.ready_at - t0
        self._count_round(result)

    def _round_failed(self, reason: str) -> None:
        if self.on_round_failed is not None:
            try:
                self.on_round_failed(reason)
            except Exception:
                log.exception("on_round_failed")

    def _drain(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if isinstance(item, _Submit):
                    self._add(item)
                elif isinstance(item, _Call):
                    self._call(item)
                else:
                    self._abort(item.request_id)
            except Exception:  # one item never stops the loop
                log.exception("inbox item %s failed", type(item).__name__)

    def _add(self, s: _Submit) -> None:
        if not s.future.set_running_or_notify_cancel():
            return  # the client left before its request was admitted
        try:
            with self.engine.grammars.handing(s.matcher):
                req = self.engine.add(s.prompt, s.params, request_id=s.request_id, messages=s.messages)
        except Exception as e:  # a ParamError is the client's 400; anything else its 500
            s.future.set_exception(e)
            return
        self.sinks[req.id] = s.sink
        self.timing[req.id] = _Timing(s.arrival)
        s.future.set_result(req)

    def _call(self, c: _Call) -> None:
        if not c.future.set_running_or_notify_cancel():
            return
        if self.stop_reason is not None:  # stopping: the parts it would use may be gone
            c.future.set_exception(RuntimeError("the engine loop is stopping"))
            return
        try:
            c.future.set_result(c.fn())
        except BaseException as e:  # the caller's to handle
            c.future.set_exception(e)

    def _abort(self, request_id: str) -> None:
        reqs = [r for r in list(self.engine.waiting) + self.engine.running if r.id == request_id]
        try:
            self.engine.abort(request_id)
        finally:
            self._publish(reqs)

    def _report_queue(self) -> None:
        if self.metrics:
            self.metrics.queue(len(self.engine.running), len(self.engine.waiting))

    def _count_round(self, result: RoundResult) -> None:
        self.rounds += 1
        self.last_round = result
        self.largest_batch = max(self.largest_batch, result.batch_size)
        for source, (drafted, kept) in result.by_drafter.items():
            counts = self.by_drafter.setdefault(source, [0, 0])
            counts[0] += drafted
            counts[1] += kept
        for phase, seconds in round_timeline(result).items():
            self.timeline[phase] += seconds
        for req in result.advanced:
            self.max_batch_seen[req.id] = max(self.max_batch_seen.get(req.id, 0), result.batch_size)
        if self.metrics:
            self.metrics.round(result)

    def _publish(self, reqs: list[Request]) -> None:
        now = time.monotonic()
        for req in reqs:
            sink = self.sinks.get(req.id)
            if sink is None:
                continue
            self._time(req, now)
            update = Update(req.delta())
            if req.finished:
                update.finish_reason, update.error = req.finish_reason, req.error
                failed = req.matcher is not None and req.matcher.failed
                if req.finish_reason == "error" and failed:  # its grammar's dead end: the client's input
                    update.error_param = req.matcher.field
                update.prompt_tokens, update.completion_tokens = req.n_prompt, len(req.generated)
                update.fly = {**req.stats.as_dict(), "max_batch_size": self.max_batch_seen.get(req.id, 0)}
                self._forget(req.id)
                self.finished[req.finish_reason] = self.finished.get(req.finish_reason, 0) + 1
                if self.metrics:
                    self.metrics.done(req.finish_reason)
            try:
                sink(update)
            except Exception:  # the handler's event loop is gone (shutdown): nobody to tell
                log.warning("request %s: its update could not be delivered", req.id, exc_info=True)

    def _time(self, req: Request, now: float) -> None:
        """Time to first token when the request's first token is out; time per output token
        (after the first) when it finishes."""
        t = self.timing.get(req.id)
        if t is None or not self.metrics:
            return
        n = len(req.tokens) - req.n_prompt
        if t.first_token is None and n > 0:
            t.first_token = now
            self.metrics.first_token(now - t.arrival)
        if req.finish_reason in ("stop", "length") and t.first_token is not None and n > 1:
            self.metrics.per_output_token((now - t.first_token) / (n - 1))

    def _forget(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        self.timing.pop(request_id, None)
        self.max_batch_seen.pop(request_id, None)

    def _fail_running(self, error: str) -> None:
        failed = list(self.engine.running)
        try:
            self.engine.fail_running(error)
        except Exception:  # releasing caches on a dead replica: the batch is already retired
            log.exception("release after a failed round")
        self._publish(failed)

    def _shutdown(self, reason: str) -> None:
        """Every request still here ends with an error, so that no handler waits for a loop that
        is gone: the waiting ones never started, the running ones are failed."""
        try:
            self._drain()  # submissions already posted get their answer too
            waiting = list(self.engine.waiting)
            for req in waiting:
                self.engine.abort(req.id)
                req.finish_reason, req.error = "error", reason
            self._fail_running(reason)
            self._publish(waiting)
        except Exception:
            log.exception("engine loop shutdown")
        self._report_queue()
