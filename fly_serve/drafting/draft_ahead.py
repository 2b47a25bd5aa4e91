"""Draft-ahead: the drafter drafts a row's next round while the target verifies this one (PEARL's
post-verify, Liu et al. ICLR 2025), so the two sides of a round work at the same time.

The bet. While round r is verified, the drafter continues each row past its last draft, on the
guess that the target keeps every draft (strictly or loosely: FLy keeps more rounds whole than
strict decoding) and that its bonus token is the drafter's own next token (Row.peek). The verdict
decides the bet: when the row's committed tokens are exactly the guess, round r+1 starts with its
drafts already made (a hit); otherwise they are dropped (a miss), the row drafts from the
corrected token, its drafter KV cache rolls back by content (kv_cache.KVCache.plan) and its
random stream by the drafter's snapshot (drafters.ModelDrafter). The decision (verify.decide) is
the same either way; only when drafts are made changes, so the outputs equal the sequential
engine's token for token.

Which rows bet: those the draft model drafts, whose MLA sources read only the row's own tokens
(prompt lookup). The suffix index and the token recycler learn between rounds (the recycler from
round r's verdict), so drafts made before that learning could differ from drafts made after it.
The model-free modes (pld, suffix, recycle) draft in microseconds: nothing to hide.

  Ahead       a row's drafts for its next round and the guess they continue
  Stages      the drafter's thread and the target's thread, each with its own torch thread budget
  DraftAhead  the engine's round hooks with draft-ahead on; Sequential, the same hooks off (the
              sequential round then reads alone: Engine._round calls the hooks either way)
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from fly_serve.contracts import RoundResult

log = logging.getLogger("fly_serve.draft_ahead")
# The MLA sources whose proposals depend on the row's tokens alone (module docstring).
ROW_LOCAL_SOURCES = frozenset({"pld"})


@dataclass
class Ahead:
    """A row's drafts for its next round, made while this round was verified."""

    base: int  # the row's token count when the bet was made
    guess: list[int]  # the tokens it bets this round commits: its drafts + the drafter's own next token
    k: int  # the k the drafts were made for
    drafts: list[int]
    q: torch.Tensor | None  # [n, V] for a sampling row (Drafts.q)
    forwards: int | None  # drafter forwards the row was in (Drafts.row_forwards)

    def won(self, tokens: list[int]) -> bool:
        """The verdict committed exactly the guess (and nothing stopped the row)."""
        return len(tokens) == self.base + len(self.guess) and tokens[self.base :] == self.guess


@dataclass
class Overlap:
    """One round's two sides run together: the verdict, the ahead drafts (None: the ahead call
    failed) and how long each side waited for the other."""

    verdict: object
    ahead: object
    verify_s: float
    ahead_s: float
    verify_wait_s: float  # the drafter idle, the ahead drafts done, waiting for the verdict
    draft_wait_s: float  # the verdict in, waiting for the ahead drafts


def _budget(threads: int) -> None:
    """This thread's torch intra-op threads (an OpenMP setting per thread). Reading the count
    first lets torch initialize this thread's setting from the process's, so the set below wins."""
    torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)


def _timed(fn, t0: float):
    out = fn()
    return out, time.perf_counter() - t0


class Stages:
    """Two single-thread stages: the drafter's and the target's. torch releases the GIL inside its
    ops, so in one process a drafter forward and a target forward run at once; with remote parts
    the two calls are in flight together. threads 0: the process's own setting."""

    def __init__(self, draft_threads: int = 0, verify_threads: int = 0):
        self.draft_threads, self.verify_threads = draft_threads, verify_threads
        self._drafter = ThreadPoolExecutor(1, "fly-draft", initializer=_budget, initargs=(draft_threads,))
        self._target = ThreadPoolExecutor(1, "fly-verify", initializer=_budget, initargs=(verify_threads,))

    def draft(self, fn, *args):
        """fn(*args) on the drafter's thread, waited for."""
        return self._drafter.submit(fn, *args).result()

    def together(self, verify, ahead) -> Overlap:
        """verify() on the target's thread while ahead() runs on the drafter's; waits for both
        (a failing verify is raised only once the drafter is idle again, so a retry finds it free).
        ahead must not raise: a failed bet is no failed round."""
        t0 = time.perf_counter()
        v = self._target.submit(_timed, verify, t0)
        a = self._drafter.submit(_timed, ahead, t0)
        wait([v, a])
        ahead_out, ahead_s = a.result()
        verdict, verify_s = v.result()
        idle_drafter, idle_target = max(0.0, verify_s - ahead_s), max(0.0, ahead_s - verify_s)
        return Overlap(verdict, ahead_out, verify_s, ahead_s, idle_drafter, idle_target)

    def under_load(self, side: str, fn, load):
        """fn() on `side`'s thread ("draft" or "verify") while load() runs over and over on the
        other's: draft-ahead's cost curves (cost_calibration.measure_profile) time each side as
        it runs in a round, beside the other."""
        stop = threading.Event()

        def busy():
            while not stop.is_set():
                load()

        mine, other = (self._drafter, self._target) if side == "draft" else (self._target, self._drafter)
        loaded = other.submit(busy)
        try:
            return mine.submit(fn).result()
        finally:
            stop.set()
            loaded.result()

    def close(self) -> None:
        self._drafter.shutdown(wait=False)
        self._target.shutdown(wait=False)


def bets(row, mode_drafter: str | None) -> bool:
    """Whether a row may draft ahead: the draft model drafts it and its MLA reads only its own tokens."""
    return mode_drafter == "model" and (not row.mla or set(row.mla_sources) <= ROW_LOCAL_SOURCES)


class Sequential:
    """The round's hooks without draft-ahead: nothing held, nothing made while verifying."""

    stages = None

    def held(self, batch, rows) -> list[Ahead | None]:
        return [None] * len(batch)

    def draft(self, propose, rows):
        return propose(rows)

    def verify(self, verify, bet, fallback: bool):
        """(verdict, [(row index, Ahead)], a RoundResult of the overlap's times)."""
        return verify(), [], RoundResult()

    def settle(self, batch, made, kept, y, result: RoundResult, observe_guess) -> None:
        pass

    def forget(self, keys) -> None:
        pass

    def close(self) -> None:
        pass


class DraftAhead(Sequential):
    """The round's hooks with draft-ahead (module docstring): each row's drafts for its next
    round (`ahead`, by request id), made on the drafter's thread while the target verifies."""

    def __init__(self, stages: Stages):
        self.stages = stages
        self.ahead: dict[str, Ahead] = {}

    def held(self, batch, rows) -> list[Ahead | None]:
        """Per row, the drafts made for this round while the last one was verified (the bet won),
        or None. A k "auto" row keeps the k its drafts were made for (k auto plans around it)."""
        held = []
        for req, row in zip(batch, rows):
            a = self.ahead.get(req.id)
            if a is not None and not a.won(req.tokens):  # a round failed after its commit began
                log.warning("draft-ahead for %s no longer continues its tokens: drafting again", req.id)
                a = None
            if a is not None and not req.params.auto_k and a.k != row.k:
                log.warning("draft-ahead for %s made for k=%d, the round has k=%d: drafting again", req.id, a.k, row.k)
                a = None
            if a is not None:
                row.k = a.k
            held.append(a)
        return held

    def draft(self, propose, rows):
        """The model drafter's call, on the drafter's thread (its torch thread budget)."""
        return self.stages.draft(propose, rows)

    def verify(self, verify, bet, fallback: bool):
        """The target's verdict while bet() drafts the next round; a drafter that just failed is
        not asked to bet."""
        if fallback:
            return super().verify(verify, bet, fallback)
        both = self.stages.together(verify, bet)
        result = RoundResult(verify_s=both.verify_s, ahead_s=both.ahead_s)
        result.verify_wait_s, result.draft_wait_s = both.verify_wait_s, both.draft_wait_s
        return both.verdict, both.ahead or [], result

    def settle(self, batch, made, kept, y, result: RoundResult, observe_guess) -> None:
        """After the commit: keep the ahead drafts whose guess the verdict confirmed, drop the
        rest (counted), and tell k "auto" whether the drafter's own next token was the bonus."""
        for req in batch:
            self.ahead.pop(req.id, None)  # held drafts were used this round
        for b, ahead in made:
            req = batch[b]
            n = len(ahead.guess) - 1
            if kept[b] == n:  # every draft kept: the guess was one more draft, kept or not
                observe_guess(req.id, y[b][n] == ahead.guess[-1])
            result.ahead_drafted += len(ahead.drafts)
            if not req.finished and ahead.won(req.tokens):
                self.ahead[req.id] = ahead
                result.ahead_hits += 1
                req.stats.ahead_hits += 1
            else:
                result.ahead_misses += 1
                result.ahead_dropped += len(ahead.drafts)
                req.stats.ahead_misses += 1
                req.stats.ahead_dropped += len(ahead.drafts)

    def forget(self, keys) -> None:
        for key in keys:
            self.ahead.pop(key, None)

    def close(self) -> None:
        self.stages.close()
