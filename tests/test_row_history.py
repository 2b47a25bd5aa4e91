"""Rows carry only the tokens a replica does not hold (deployments/parts/row_history.py), no Ray: the
remote parts over fake handles that call real replicas' code in-process, with a replica that
restarts (forgets every row) in the middle of a generation."""

import threading
import time

import pytest

from deployments.parts.remote_parts import Releases, RemoteDrafter, RemoteScorer
from deployments.parts.row_history import RowHistory, RowSender, RowsUnknown, rows_unknown
from fly_serve.build import (
    EngineConfig,
    assemble_engine,
    build_engine,
    drafts_under_grammar,
    grammars_for,
    load_drafter,
    load_scorer,
)
from fly_serve.contracts import Row
from fly_serve.loading.loading import load_tokenizer


class Done:
    """A Serve response that is already done."""

    def __init__(self, call):
        try:
            self.value, self.error = call(), None
        except Exception as e:
            self.value, self.error = None, e

    def result(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Done(lambda: self.fn(*args))


class Replica:
    """A part as its replica holds it: a RowHistory in front, and what each call carried."""

    def __init__(self, part, method: str):
        self.part, self.method, self.history = part, method, RowHistory()
        self.sent_tokens = 0  # tokens received, all calls together

    def call(self, rows, *rest):
        self.sent_tokens += sum(len(r.tokens) for r in rows)
        return getattr(self.part, self.method)(self.history.whole(rows), *rest)

    def release(self, keys):
        self.history.release(keys)
        self.part.release(keys)

    def restart(self):
        self.history = RowHistory()


class Handle:
    def __init__(self, replica: Replica):
        self.replica = replica

    def options(self, **_):
        return self

    def __getattr__(self, name):
        if name in ("verify", "propose"):
            return Method(self.replica.call)
        if name == "release":
            return Method(self.replica.release)
        if name == "kv_capacity":
            return Method(lambda: self.replica.part.kv_capacity_tokens)
        raise AttributeError(name)


def test_history_puts_rows_back_together_and_refuses_what_it_does_not_hold():
    history, sender = RowHistory(), RowSender()
    row = Row("a", [1, 2, 3])
    assert history.whole(sender.compact([row]))[0].tokens == [1, 2, 3]
    sender.sent([row])
    row.tokens += [4, 5]
    compact = sender.compact([row])[0]
    assert (compact.tokens, compact.start) == ([4, 5], 3)
    assert history.whole([compact])[0].tokens == [1, 2, 3, 4, 5]
    assert history.whole([compact])[0].tokens == [1, 2, 3, 4, 5]  # a retried call: the same row
    with pytest.raises(RowsUnknown) as e:
        RowHistory().whole([compact])
    assert e.value.keys == ["a"] and rows_unknown(RuntimeError("wrapped")) is False
    wrapped = RuntimeError("from a replica")
    wrapped.cause = e.value  # as Ray's RayTaskError carries it
    assert rows_unknown(wrapped)
    sender.forget(["a"])
    assert sender.compact([row])[0].start == 0


@pytest.mark.parametrize("mode", ["fly", "spd", "ar"])
def test_remote_parts_send_new_tokens_only_and_survive_a_restart(mode):
    config = EngineConfig(target="tiny:0", drafter="tiny:1", max_model_len=256)
    params = {"mode": mode, "k": 4, "max_tokens": 40}
    prompts = ["def add(a, b):\n    return", "hello hello hello"]
    expected = [r.text for r in build_engine("tiny:0", "tiny:1", max_model_len=256).generate(prompts, params)]

    target, drafter = Replica(load_scorer(config), "verify"), Replica(load_drafter(config), "propose")
    tokenizer = load_tokenizer("tiny:0")
    engine = assemble_engine(
        config, RemoteScorer(Handle(target), len(tokenizer)), RemoteDrafter(Handle(drafter)), tokenizer
    )
    reqs = [engine.add(p, params) for p in prompts]
    rounds = 0
    while not all(r.finished for r in reqs):
        engine.step()
        rounds += 1
        if rounds == 3:  # both replicas restart: they hold no row any more
            target.restart()
            drafter.restart()
    assert [r.text for r in reqs] == expected
    whole = sum(len(r.tokens) for r in reqs) * rounds  # what sending every row whole would cost, at most
    assert target.sent_tokens < whole / 2, (target.sent_tokens, whole)


class Unanswered:
    """A Serve response that never answers (its replica is gone): result waits out its timeout."""

    def __init__(self):
        self.waited_on: list[int] = []  # the threads that waited for it
        self.cancelled = threading.Event()

    def result(self, timeout_s=None):
        self.waited_on.append(threading.get_ident())
        self.cancelled.wait(timeout_s)
        raise TimeoutError

    def cancel(self):
        self.cancelled.set()


class Gone:
    """A handle of a deployment whose replica is gone: every call is Unanswered."""

    def __init__(self):
        self.calls: list[Unanswered] = []

    def options(self, **_):
        return self

    def __getattr__(self, name):
        outer = self

        class Call:
            def remote(self, *args):
                outer.calls.append(Unanswered())
                return outer.calls[-1]

        return Call()


def test_releases_are_sent_and_confirmed_off_the_engine_thread():
    """With one pool's replica gone, a retire costs the engine thread no wait: the releases are
    sent there and waited for on the releases thread, which cancels each one that did not answer
    within the release timeout (then it keeps no place in a queue)."""
    target, drafter = Gone(), Gone()
    RemoteScorer(target, 10, timeout_s=0.2).release(["a"])
    RemoteDrafter(drafter, timeout_s=0.2).release(["a", "b"])
    calls = target.calls + drafter.calls
    assert len(calls) == 2  # sent, one call per replica group
    for call in calls:
        assert call.cancelled.wait(10), "an unanswered release was never cancelled"
        assert call.waited_on and threading.get_ident() not in call.waited_on


def test_releases_waiting_are_bounded():
    releases = Releases(max_pending=2)
    held = threading.Event()
    blocker = Unanswered()
    blocker.result = lambda timeout_s=None: held.wait(timeout_s)  # the releases thread waits on it
    waiting = [Unanswered() for _ in range(4)]
    releases.confirm([blocker], 30, "drafter")
    deadline = time.monotonic() + 10
    while releases.pending.qsize():  # the thread took the blocker and waits for it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    releases.confirm(waiting, 30, "drafter")
    assert releases.dropped == 2 and [c.cancelled.is_set() for c in waiting] == [False, False, True, True]
    held.set()
    for call in waiting[:2]:  # answered: the thread confirms them and goes on
        call.cancel()


def test_a_drafter_pool_drafts_under_a_grammar_as_its_replicas_drafter_does():
    """The ingress's RemoteDrafter for a pool says what the pool's replicas' drafter says: one of
    the target's tokenizer drafts under a row's grammar, one of another family does not."""
    config = EngineConfig(
        target="tiny:0", drafter=None, drafters={"same": "tiny:1", "cross": "tiny-sp:2"}, max_model_len=256
    )
    quiet = dict(progress=lambda _: None)
    tokenizer, grammars = load_tokenizer("tiny:0"), grammars_for(config, **quiet)
    said = {}
    for name in ("same", "cross"):
        in_replica = load_drafter(config, name=name, **quiet).share_grammars(grammars)
        said[name] = RemoteDrafter(None, grammars=drafts_under_grammar(config, name, tokenizer)).share_grammars(
            grammars
        )
        assert said[name] == in_replica, name
    assert said == {"same": True, "cross": False}
