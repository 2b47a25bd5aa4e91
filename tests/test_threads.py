"""A serving process runs its torch work on one thread (deployments/parts/threads.py says why: one
OpenMP team per process), and the ingress's engine loop is that thread."""

import asyncio
import threading

import pytest

from deployments.ingress.engine_loop import EngineLoop
from deployments.parts.threads import on_torch_thread, on_torch_thread_async
from fly_serve.build import build_engine


def test_work_from_many_threads_and_coroutines_runs_on_one_thread():
    seen = []

    def work(i):
        seen.append(threading.get_ident())
        return i * i

    callers = [threading.Thread(target=on_torch_thread, args=(work, i)) for i in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()

    async def both():
        return await asyncio.gather(on_torch_thread_async(work, 5), on_torch_thread_async(work, 6))

    assert asyncio.run(both()) == [25, 36]
    assert on_torch_thread(work, 7) == 49
    assert len(seen) == 7 and len(set(seen)) == 1
    assert seen[0] not in {t.ident for t in callers} | {threading.get_ident()}


def test_a_call_from_the_torch_thread_runs_inline_and_errors_reach_the_caller():
    def outer():
        return threading.get_ident(), on_torch_thread(threading.get_ident)  # would deadlock if queued

    here, nested = on_torch_thread(outer)
    assert here == nested

    def broken():
        raise ValueError("bad shapes")

    with pytest.raises(ValueError, match="bad shapes"):
        on_torch_thread(broken)
    with pytest.raises(ValueError, match="bad shapes"):
        asyncio.run(on_torch_thread_async(broken))


def test_the_engine_loop_builds_its_engine_and_runs_calls_and_rounds_on_its_thread():
    threads = {}

    def build():
        threads["build"] = threading.get_ident()
        engine = build_engine("tiny:0", "tiny:1", max_model_len=256, progress=lambda _: None)
        verify = engine.scorer.verify

        def verify_here(rows, drafts):
            threads["verify"] = threading.get_ident()
            return verify(rows, drafts)

        engine.scorer.verify = verify_here
        return engine

    loop = EngineLoop(build)
    try:
        assert threads["build"] == loop.thread.ident != threading.get_ident()
        assert loop.call(threading.get_ident).result(timeout=30) == loop.thread.ident
        # a call from the loop's own thread runs at once (queued, it would wait for itself)
        nested = loop.call(lambda: loop.call(threading.get_ident).result(timeout=5))
        assert nested.result(timeout=30) == loop.thread.ident
        done = threading.Event()
        loop.submit([1, 2, 3], {"mode": "spd", "k": 3, "max_tokens": 4}, "r1", lambda u: u.finish_reason and done.set())
        assert done.wait(60)
        assert threads["verify"] == loop.thread.ident
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0).result(timeout=30)
    finally:
        loop.stop("test over")
        loop.thread.join(10)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(threading.get_ident).result(timeout=5)


def test_an_engine_that_fails_to_build_fails_the_loop_constructor():
    def build():
        raise OSError("no weights here")

    with pytest.raises(OSError, match="no weights here"):
        EngineLoop(build)
