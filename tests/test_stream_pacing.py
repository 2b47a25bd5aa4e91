"""A generation's updates paced on the engine thread (deployments/ingress/stream_pacing.py): a
stream's first text and its end at once, the text between merged into a delivery at most every
interval, nothing lost or reordered, a failure after the text held before it; an answer sent
whole delivered once, at its end. The clock is the test's: each update carries its time."""

import pytest

from deployments.ingress.engine_loop import Update
from deployments.ingress.stream_pacing import WHOLE, Pacer


def run(timed: list[tuple[float, Update]], interval_s: float) -> list[tuple[float, Update]]:
    """A Pacer fed the updates at the given times; what it delivered, and when."""
    now = [0.0]
    out: list[tuple[float, Update]] = []
    pacer = Pacer(lambda u: out.append((now[0], u)), interval_s, clock=lambda: now[0])
    for t, u in timed:
        now[0] = t
        pacer(u)
    return out


def tokens(n: int, every_s: float) -> list[tuple[float, Update]]:
    """n one-token updates every every_s; the last finishes the request (with usage)."""
    out = [(i * every_s, Update(f"t{i} ")) for i in range(n)]
    t, last = out[-1]
    out[-1] = (t, Update(last.text, finish_reason="length", prompt_tokens=3, completion_tokens=n))
    return out


def text_of(chunks) -> str:
    return "".join(u.text for _, u in chunks)


def test_no_interval_passes_every_update_through():
    timed = tokens(10, 0.01)
    assert run(timed, 0.0) == timed


def test_text_goes_out_at_most_once_an_interval_and_arrives_whole():
    timed = tokens(40, 0.037)  # a token every 37 ms, a chunk at most every 200 ms
    chunks = run(timed, 0.2)
    assert text_of(chunks) == "".join(u.text for _, u in timed)
    assert chunks[0] == (0.0, timed[0][1])  # the first token at once: the TTFT is not paced
    sent = [t for t, _ in chunks]
    assert all(b - a >= 0.2 for a, b in zip(sent[:-1], sent[1:-1]))  # the end may follow sooner
    assert len(chunks) <= 2 + 40 * 0.037 / 0.2
    assert len(chunks) >= 40 * 0.037 / 0.2 - 1  # and held no longer than the next update past the interval


def test_the_last_update_goes_out_at_once_with_the_text_held_before_it():
    timed = tokens(5, 0.01)
    chunks = run(timed, 10.0)
    assert [u.text for _, u in chunks] == ["t0 ", "t1 t2 t3 t4 "]
    last = chunks[-1][1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 3, 5)


def test_updates_without_text_wait_for_the_first_text():
    timed = [(0.0, Update("")), (0.01, Update("")), (0.02, Update("a")), (0.03, Update("b", finish_reason="stop"))]
    chunks = run(timed, 1.0)
    assert [(t, u.text, u.finish_reason) for t, u in chunks] == [(0.02, "a", None), (0.03, "b", "stop")]


@pytest.mark.parametrize("interval_s", [0.0, 1.0, WHOLE])
def test_a_failure_comes_after_the_text_held_before_it(interval_s):
    failed = Update("d", finish_reason="error", error="the replica died")
    timed = [(0.0, Update("a")), (0.01, Update("b")), (0.02, Update("c")), (0.03, failed)]
    chunks = run(timed, interval_s)
    assert text_of(chunks) == "abcd"
    assert chunks[-1][1] is failed and all(u.error is None for _, u in chunks[:-1])


def test_an_answer_sent_whole_is_delivered_once_at_its_end():
    timed = tokens(30, 0.04)
    chunks = run(timed, WHOLE)
    assert len(chunks) == 1
    t, u = chunks[0]
    assert t == timed[-1][0] and u.text == text_of(timed) and u.finish_reason == "length"
    assert (u.prompt_tokens, u.completion_tokens) == (3, 30)
