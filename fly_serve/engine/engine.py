"""The round loop: draft -> verify in one target forward -> decide for the whole batch -> commit.

Requests join (add) and leave (finish, abort) between rounds. Every mode is the same round
(params.MODES): `ar` drafts nothing (the target forward then decodes one token), `pld` drafts by
prompt lookup, `suffix` from the suffix index, `recycle` by Token Recycling, `spd` and `fly` with
the draft model; `fly` decides with the gate and window, the others strictly. So a batch may mix
modes and knobs freely.

Two draft sources learn from the engine's own traffic and are shared by all its sequences (and
by the model drafter as MLA levels): the suffix index stores every request that finishes (prompt
and output as one sequence, so a request like an earlier one is continued from its first token),
within a token bound that evicts the oldest; the token recycler takes the target's top-k ids at
every verified position of every round (Verdict.topk), whatever the rows' modes.

Several drafters: the engine may hold more than one draft model, by name (the first is the
default; each may be of another tokenizer: drafting/cross_vocab.py). A request names one
(Params.drafter) or lets k auto choose each round, per row, by the row's acceptance with each and
each one's cost (speculation_policy.py); rows of one round may draft with different ones, each
drafter drafting its rows in one call. Each request's stats and each round say which drafter (or
model-free source) drafted how many tokens and how many were kept.

Draft-ahead (draft_ahead.py, EngineConfig.draft_ahead): the round becomes a pipeline of two
stages on two threads. While the target verifies round r, the drafter drafts round r+1 for every
row that bets, on the guess that the verdict keeps all of round r's drafts and that the bonus is
the drafter's own next token; the rows whose guess the verdict confirms start round r+1 with
their drafts made, the others draft again. Outputs are the sequential round's, token for token.
"""

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import replace

import torch

from fly_serve.contracts import Drafter, Drafts, RoundResult, Row, RowChat, RowGrammar, RowTokens, Scorer
from fly_serve.decision.grammar import GrammarFailed, Grammars, Matcher
from fly_serve.decision.verify import decide, plausible_mask, window_positions
from fly_serve.drafting.draft_ahead import Ahead, DraftAhead, Sequential, Stages, bets
from fly_serve.drafting.drafters import LookupDrafter, PromptLookup, SourceDrafter
from fly_serve.drafting.prompt_lookup import LookupIndexes
from fly_serve.drafting.suffix_index import SuffixIndex
from fly_serve.drafting.token_recycling import TokenRecycling
from fly_serve.k_auto.allocator import RowInfo
from fly_serve.k_auto.lookup_match import MATCH_CAP, offer_width
from fly_serve.k_auto.round_cost import NONE, PLD, CostProfile
from fly_serve.k_auto.speculation_policy import RoundTrace, SpeculationPolicy, free_key

from . import prompts
from .detokenizer import IncrementalText, find_stop, held_back
from .drafter_backoff import DrafterBackoff
from .params import ParamError, Params, shown
from .request_stats import RequestStats

log = logging.getLogger("fly_serve.engine.engine")

DEFAULT_DRAFTER_NAME = "drafter"  # the name of a single model drafter given without one


def _at(per_row: list[int] | None, b: int) -> int:
    return 0 if per_row is None else per_row[b]


def _spread(per_row: list[int] | None, n_rows: int, idx: list[int], values: list[int] | None) -> list[int] | None:
    """A per-row report (None: nobody reported) with values[i] at row idx[i]; values None: unchanged."""
    if values is None or not idx:
        return per_row
    per_row = per_row or [0] * n_rows
    for i, b in enumerate(idx):
        per_row[b] = values[i]
    return per_row


def _all_legal(drafts: Drafts, b: int) -> bool:
    """Row b's drafts all allowed by its grammar: its masks cover them all and the position after
    (_constrain; Matcher.plan)."""
    return drafts.masks is None or drafts.masks[b] is None or drafts.masks[b].shape[0] == len(drafts.tokens[b]) + 1


def kv_need(n_prompt: int, params: Params) -> int:
    """KV tokens a request may hold at its longest: its whole output plus one round's drafts."""
    return n_prompt + params.max_tokens + params.k_cap + 1


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: Params, tokenizer):
        self.id, self.params = request_id, params
        self.tokens = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.stats = RequestStats()
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the request failed (finish_reason "error")
        self.text = ""  # the output so far, cut at a stop string
        self.streamed = 0  # characters of text already handed out by delta()
        self.detokenizer = IncrementalText(tokenizer)
        self.matcher: Matcher | None = None  # its grammar's state after `tokens` (structured output)
        self.chat: RowChat | None = None  # a chat request's conversation (a drafter of another tokenizer renders it)
        self.drafter: str | None = None  # the model drafter drafting it now (by name; None: the default)
        self.drafter_seen: dict[str | None, int] = {}  # per model drafter, the tokens it had when it last drafted
        # The seed of its draws (sampling.py: keyed by seed and position, shared by drafter and
        # target); a request without one gets a random one here, once
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta(self) -> str:
        """Text not yet handed out; holds back what may still change (a partial UTF-8 character,
        the start of a stop string) until the request finishes."""
        end = len(self.text) - (0 if self.finished else held_back(self.text, self.params.stop))
        out = self.text[self.streamed : end]
        self.streamed = max(self.streamed, end)
        return out


class Engine:
    def __init__(
        self,
        scorer: Scorer,
        drafter: Drafter | dict[str, Drafter] | None,
        tokenizer,
        eos_ids=(),
        max_batch: int = 8,
        max_model_len: int = 4096,
        defaults: Params | None = None,
        speculation_profile: CostProfile | dict | None = None,
        suffix_max_tokens: int = 1_000_000,
        recycle_top_k: int = 8,
        draft_ahead: bool = False,
        draft_threads: int = 0,
        verify_threads: int = 0,
    ):
        self.scorer, self.tokenizer = scorer, tokenizer
        # Learned from this engine's traffic, shared by all sequences (module docstring). The
        # index's arrays (~30 B a token slot at the default bound) and the recycler's table
        # (vocab x top_k int32) are allocated on first use.
        self.suffix_index = SuffixIndex(max_tokens=suffix_max_tokens)
        self.recycler = TokenRecycling(scorer.vocab_size, top_k=recycle_top_k)
        # The model drafters by name, the default first: drafters["model"] is the default, `others`
        # the rest (a single drafter given unnamed is DEFAULT_DRAFTER_NAME)
        named = drafter if isinstance(drafter, dict) else {} if drafter is None else {DEFAULT_DRAFTER_NAME: drafter}
        self.drafter_names: tuple[str, ...] = tuple(named)
        self.others: dict[str, Drafter] = dict(list(named.items())[1:])
        # Prompt lookup's index of each running row's n-grams, grown as the row grows (O(new
        # tokens) a round, prompt_lookup.py), shared by its free drafts, the pld mode and the
        # model drafter's MLA level in this process
        self.lookups = LookupIndexes()
        self.drafters: dict[str, Drafter | None] = {
            "pld": LookupDrafter(indexes=self.lookups),
            "suffix": SourceDrafter(self.suffix_index),
            "recycle": SourceDrafter(self.recycler),
            "model": next(iter(named.values()), None),
        }
        for d in named.values():  # each drafter says what it does with them (contracts.Drafter)
            d.share_sources(
                {"suffix": self.suffix_index, "recycle": self.recycler, "pld": PromptLookup(indexes=self.lookups)}
            )
        # A model row's free alternative (_free_offer) looks up at least two tokens of context: a
        # one-token match proposes mostly noise in prose, and each try costs a wider verification.
        self.free_lookup = PromptLookup(min_n=2, indexes=self.lookups)
        self.eos_ids = set(eos_ids)
        self.grammars = Grammars(tokenizer, scorer.vocab_size, self.eos_ids)  # structured output
        # whether the model drafter drafts under a row's grammar (its drafts then legal, so a
        # constrained row may bet under draft-ahead); a drafter without the method does not
        sees = {name: getattr(d, "share_grammars", None) for name, d in named.items()}
        self.sees_grammar = {name: bool(share and share(self.grammars)) for name, share in sees.items()}
        self.drafter_sees_grammar = self.sees_grammar.get(self.default_drafter, False)
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.defaults = defaults or Params()
        # k "auto": the round's cost model (measured where it runs: cost_calibration.py) and each
        # row's acceptance
        self.policy = SpeculationPolicy.from_profile(speculation_profile)
        self.policy.set_drafters(self.drafter_names)
        self.drafter_backoff = DrafterBackoff()  # drafters that failed: out of k auto's choice a while
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        # The round's draft-ahead hooks (drafting/draft_ahead.py): Sequential, or DraftAhead with
        # the drafter's and the target's threads and each row's drafts for its next round
        self.pipeline: Sequential = Sequential()
        self.set_draft_ahead(draft_ahead, draft_threads, verify_threads)

    def set_draft_ahead(self, on: bool, draft_threads: int = 0, verify_threads: int = 0) -> None:
        """Draft-ahead on or off, with each side's torch threads (0: the process's), while no
        request runs (EngineConfig.draft_ahead at start; a benchmark switches it between runs)."""
        if self.running:
            raise RuntimeError("draft-ahead is switched only while no request runs")
        self.pipeline.close()
        on = on and self.drafters["model"] is not None
        self.pipeline = DraftAhead(Stages(draft_threads, verify_threads)) if on else Sequential()
        if on:  # CUDA graph capture is process-wide: a capture on one stage's thread would break
            # (or be broken by) the other stage's kernels, so in-process parts replay none
            for part in (self.scorer, self.drafters["model"]):
                runner = getattr(part, "runner", None)
                if getattr(runner, "graphs", None) is not None:
                    log.info("draft-ahead: CUDA graphs off for %s (two stages share the process)", type(part).__name__)
                    runner.graphs = None
        if on:  # a llama.cpp part has its own thread count, not torch's (llama_runner.py)
            for part, n in ((self.drafters["model"], draft_threads), (self.scorer, verify_threads)):
                runner = getattr(part, "runner", None)
                if n > 0 and hasattr(runner, "set_threads"):
                    runner.set_threads(n)
        self.policy.set_overlap(on)

    @property
    def default_drafter(self) -> str | None:
        return self.drafter_names[0] if self.drafter_names else None

    def model_drafter(self, name: str | None) -> Drafter | None:
        """The model drafter of this name (None or the default's: drafters["model"])."""
        return self.drafters["model"] if name is None or name == self.default_drafter else self.others.get(name)

    @property
    def stages(self) -> Stages | None:
        """Draft-ahead's two threads (None: sequential), for the calibration that times each side."""
        return self.pipeline.stages

    # ---- requests in and out
    def add(
        self,
        prompt: str | list[int],
        params: Params | dict | None = None,
        request_id: str | None = None,
        messages: list[dict] | None = None,
    ) -> Request:
        """Queue a request; raises ParamError naming the bad field (nothing else is affected).
        messages: a chat request's conversation, which `prompt` is the rendering of (a drafter of
        another tokenizer renders it with its own template)."""
        req = self.admit(prompt, params, request_id, messages)
        self.waiting.append(req)
        return req

    def admit(
        self,
        prompt: str | list[int],
        params: Params | dict | None = None,
        request_id: str | None = None,
        messages: list[dict] | None = None,
    ) -> Request:
        """A checked Request, not yet queued: everything that could break a round is caught here."""
        params = self.defaults.merged(params or {}) if not isinstance(params, Params) else params
        if isinstance(prompt, str):
            prompt = prompts.completion_prompt(self.tokenizer, prompt)  # raw text: BOS where the model has one
        params.validate(len(prompt), self.max_model_len)
        vocab = self.scorer.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise ParamError("prompt", f"token ids must be integers in [0, {vocab})")
        need, capacity = kv_need(len(prompt), params), self.kv_capacity()
        if capacity is not None and need > capacity:
            raise ParamError(
                "max_tokens",
                f"prompt + max_tokens + k + 1 = {need} tokens can never fit the KV cache of {capacity} tokens",
            )
        if params.mode_spec.source and self.drafters[params.mode_spec.source] is None:
            raise ParamError("mode", f"{params.mode!r} needs a draft model and this engine has none")
        if params.drafter is not None and params.drafter not in self.drafter_names:
            known = ", ".join(self.drafter_names) or "none"
            raise ParamError("drafter", f"no drafter named {shown(params.drafter)} here (drafters: {known})")
        req = Request(request_id or f"req-{next(self._ids)}", prompt, params, self.tokenizer)
        req.matcher = self.grammars.matcher(params)
        req.drafter = params.drafter
        if messages:
            turns = tuple((str(m.get("role", "")), str(m.get("content") or "")) for m in messages)
            req.chat = RowChat(turns, len(prompt))
        return req

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting) + self.running:
            if req.id == request_id and not req.finished:
                req.finish_reason = "abort"
        self.waiting = deque(r for r in self.waiting if not r.finished)
        self._retire()

    def fail_running(self, error: str) -> list[Request]:
        """End every running request with an error (e.g. when the service stops); returns them."""
        failed = [r for r in self.running if not r.finished]
        for req in failed:
            req.finish_reason, req.error = "error", error
        self._retire()
        return failed

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts, params=None) -> list[Request]:
        """Run prompts to completion together; params: one for all, or one per prompt."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add(p, q) for p, q in zip(prompts, per)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ---- one round
    def step(self) -> RoundResult:
        """One round over the running batch. A failing round is retried once (a replica may be
        being replaced); if it fails again the batch is bisected, so that a row that breaks the
        round fails alone while the others advance. A failure that every part of the batch
        meets (a dead target) fails the batch at once rather than after log2(B) more tries."""
        self._admit_waiting()
        batch = list(self.running)
        if not batch:
            return RoundResult()
        try:
            result = self._try_twice(batch)
        except Exception as e:
            result = self._isolate(batch, e)
        self._retire()
        return result

    def kv_capacity(self) -> int | None:
        """Tokens every part's KV cache can hold at once (the smallest), None if unknown."""
        parts = [self.scorer, self.drafters["model"], *self.others.values()]
        known = [c for c in (getattr(p, "kv_capacity_tokens", None) for p in parts if p is not None) if c]
        return min(known) if known else None

    def draft_sources(self) -> dict:
        """What the model-free draft sources hold in memory: the suffix index grows with every
        finished request up to suffix_max_tokens, Token Recycling's table with the vocabulary."""
        index = self.suffix_index
        return {
            "suffix": {"tokens": index.num_tokens, "sequences": index.num_sequences, "bytes": index.nbytes},
            "recycle": {"bytes": self.recycler.nbytes},
        }

    def _admit_waiting(self) -> None:
        """Running requests reserve their whole KV need (prompt + max_tokens + a round's drafts), so
        a request joins only when it fits beside them, and no sequence can run the cache out."""
        capacity = self.kv_capacity()
        used = sum(kv_need(r.n_prompt, r.params) for r in self.running)
        while self.waiting and len(self.running) < self.max_batch:
            need = kv_need(self.waiting[0].n_prompt, self.waiting[0].params)
            if capacity is not None and used + need > capacity:
                break  # first come, first served: it waits until running requests finish
            used += need
            self.running.append(self.waiting.popleft())

    def _try_twice(self, batch: list[Request]) -> RoundResult:
        try:
            return self._round(batch)
        except Exception:
            log.warning("round of %d rows failed; retrying once", len(batch), exc_info=True)
            return self._round(batch)

    def _isolate(self, batch: list[Request], error: Exception) -> RoundResult:
        """Bisect a batch whose round failed twice; fail the rows that still fail alone."""
        if len(batch) == 1:
            return self._fail(batch, error)
        halves = [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
        outcomes = []
        for half in halves:
            try:
                outcomes.append(self._round(half))
            except Exception as e:
                outcomes.append(e)
        if all(isinstance(o, Exception) for o in outcomes):  # not row-specific: the part is down
            return self._fail(batch, error)
        merged = RoundResult()
        for half, o in zip(halves, outcomes):
            merged.merge(self._isolate(half, o) if isinstance(o, Exception) else o)
        return merged

    def _fail(self, batch: list[Request], error: Exception) -> RoundResult:
        log.error("round failed for %s", [r.id for r in batch], exc_info=error)
        for req in batch:
            req.finish_reason, req.error = "error", f"{type(error).__name__}: {error}"
        return RoundResult(advanced=list(batch), failed=list(batch))

    def _round(self, batch: list[Request]) -> RoundResult:
        """Draft, verify, decide and commit for these requests; nothing is committed unless all
        of it succeeds. The pipeline's hooks (drafting/draft_ahead.py) do nothing in a sequential
        engine; with draft-ahead, rows whose bet won come with the drafts made during the last
        round (held), the drafter bets on the next round while the target verifies (verify), and
        the bets are settled after the commit (settle)."""
        rows = [self._row(r) for r in batch]
        held = self.pipeline.held(batch, rows)
        free = self._choose_ks(batch, rows, held)
        clock = [time.perf_counter()]  # the round's phase boundaries: draft, verify, decide
        drafts, fallback = self._draft(batch, rows, held, free)
        clock.append(time.perf_counter())
        verdict, made, result = self.pipeline.verify(
            lambda: self.scorer.verify(rows, drafts), lambda: self._bets(batch, rows, drafts), fallback
        )
        clock.append(time.perf_counter())
        accept_len, loosely = self._decide(batch, drafts, verdict)
        clock.append(time.perf_counter())
        self._recycle(rows, drafts, verdict)
        kept, y = accept_len.tolist(), verdict.y.tolist()
        committed = [self._commit(req, drafts.tokens[b][: kept[b]] + [y[b][kept[b]]]) for b, req in enumerate(batch)]
        self._account(batch, drafts, verdict, kept, loosely, committed, clock, fallback, result)
        self._by_source(batch, rows, free, drafts, kept, result)
        self.policy.record(self._trace(batch, rows, held, free, drafts, kept, result))
        self.pipeline.settle(batch, made, kept, y, result, self.policy.observe_guess)
        return result

    @staticmethod
    def _account(batch, drafts: Drafts, verdict, kept, loosely, committed, clock, fallback, result: RoundResult):
        """The round's counts and times, in its RoundResult and each request's stats."""
        result.advanced, result.drafting_rows = list(batch), sum(1 for d in drafts.tokens if d)
        result.draft_s, result.decide_s = clock[1] - clock[0], clock[3] - clock[2]
        result.verify_s = result.verify_s or clock[2] - clock[1]
        result.drafter_fallback = fallback
        # a remote part reports its compute; the rest of the call was transport
        result.draft_compute_s = result.draft_s if drafts.compute_s is None else drafts.compute_s
        result.verify_compute_s = result.verify_s if verdict.compute_s is None else verdict.compute_s
        n_loose = loosely.sum(1).tolist()
        for b, req in enumerate(batch):
            n, loose = len(drafts.tokens[b]), n_loose[b]
            accepted = kept[b] - loose
            req.stats.add_round(n, accepted, loose, result)
            result.drafted += n
            result.accepted += accepted
            result.loosely_accepted += loose
            result.emitted += committed[b]
            if loose:
                req.stats.note_loose(req.n_generated - committed[b], loosely[b], committed[b])
            hit, draft_hit = _at(verdict.prefix_hit_tokens, b), _at(drafts.prefix_hit_tokens, b)
            req.stats.add_prefix_hits(hit, draft_hit)
            result.prompt_tokens += req.n_prompt if req.stats.rounds == 1 else 0
            result.prefix_hit_tokens += hit
            result.draft_prefix_hit_tokens += draft_hit

    def _source(self, req: Request, row: Row, free: dict) -> str | None:
        """What drafted the row this round: a model drafter's name, a model-free source's kind
        (a model row's free drafts: its first MLA source), None for plain decoding."""
        kind = req.params.mode_spec.source
        if kind != "model":
            return kind
        if row.key in free:
            return free[row.key]
        return req.drafter or self.default_drafter

    def _by_source(self, batch, rows: list[Row], free: dict, drafts: Drafts, kept: list[int], result) -> None:
        """Each drafter's (and model-free source's) drafts and kept drafts, in the request's stats
        and the round's."""
        named = {rows[b].key: name for b, (name, _) in free.items()}
        for b, req in enumerate(batch):
            n = len(drafts.tokens[b])
            source = self._source(req, rows[b], named)
            if n and source is not None:
                req.stats.add_source(source, n, kept[b])
                counts = result.by_drafter.setdefault(source, [0, 0])
                counts[0] += n
                counts[1] += kept[b]

    def _trace(self, batch, rows: list[Row], held, free: dict, drafts: Drafts, kept: list[int], result) -> RoundTrace:
        """What k auto learns from the round: per row how it drafted and what it kept."""
        default = self.default_drafter
        model = [req.params.mode_spec.source == "model" and b not in free for b, req in enumerate(batch)]
        return RoundTrace(
            [free_key(r.key) if b in free else self.policy.key_of(r.key, batch[b].drafter) for b, r in enumerate(rows)],
            [len(d) for d in drafts.tokens],
            kept,
            [PLD if b in free else req.params.mode_spec.source or NONE for b, req in enumerate(batch)],
            draft_s=result.draft_s,
            verify_s=result.verify_s,
            forwards=drafts.forwards,
            row_forwards=drafts.row_forwards,
            ahead=[h is not None for h in held],
            prefilled=any(req.stats.rounds == 1 for req in batch),
            others=any(m and req.drafter not in (None, default) for m, req in zip(model, batch)),
        )

    # ---- draft-ahead (drafting/draft_ahead.py): the bets
    def _bets(self, batch: list[Request], rows: list[Row], drafts: Drafts) -> list[tuple[int, Ahead]] | None:
        """The drafter's side of the overlap: for every row that bets, its drafts for round r+1
        after this round's drafts and the drafter's own next token (Row.peek). On the drafter's
        thread; never raises (a failed bet fails no round: its rows draft as usual next round)."""
        idx, bet_rows = [], []
        for b, (req, row) in enumerate(zip(batch, rows)):
            d = drafts.tokens[b]
            k = self._next_k(req, row.k, len(d) + 1)
            # A constrained row bets only with a drafter that drafts under its grammar (its guess is
            # then a token the grammar allows) and drafts all legal: a sampled refused draft, kept
            # for its rejection (_constrain), is sure to lose the bet.
            free = req.matcher is None or (self.drafter_sees_grammar and _all_legal(drafts, b))
            # the pipeline's drafter is the default one (draft_ahead.py): another's rows make no bet
            free = free and req.drafter in (None, self.default_drafter)
            if k > 0 and free and bets(row, req.params.mode_spec.source) and not self.eos_ids.intersection(d):
                idx.append(b)
                bet_rows.append(replace(row, tokens=row.tokens + d, k=k, peek=True, guessed=len(d)))
        if not idx:
            return []
        try:
            got = self.drafters["model"].propose(bet_rows)
        except Exception:
            log.warning("draft-ahead failed; its rows draft next round as usual", exc_info=True)
            return None
        made = []
        for i, b in enumerate(idx):
            guess = got.guesses[i] if got.guesses is not None else None
            if guess is None:  # a drafter that does not peek made no bet
                continue
            forwards = got.row_forwards[i] if got.row_forwards is not None else None
            guessed = drafts.tokens[b] + [guess]
            made.append((b, Ahead(len(rows[b].tokens), guessed, bet_rows[i].k, got.tokens[i], got.q[i], forwards)))
        return made

    def _room(self, req: Request, n_new: int = 0) -> int:
        """The most drafts a round may give the request once n_new more tokens are committed: a
        round emits at most k + 1, never past max_tokens or the context."""
        p = req.params
        return min(p.max_tokens - req.n_generated, self.max_model_len - len(req.tokens)) - n_new - 1

    def _next_k(self, req: Request, k_now: int, n_new: int) -> int:
        """The k a row gets next round if this one commits n_new tokens (as _row computes it; a k
        "auto" row keeps this round's)."""
        return max(0, min(k_now if req.params.auto_k else req.params.k_cap, self._room(req, n_new)))

    def _choose_ks(self, batch: list[Request], rows: list[Row], held: list[Ahead | None]) -> dict[int, tuple]:
        """k "auto" rows get this round's k from the policy, which weighs every row's expected
        tokens against the round's predicted seconds; fixed-k rows, and rows whose drafts were
        made ahead, share the round as they are. A model row may instead draft what its
        model-free sources propose (no drafter forward) where the policy predicts that faster:
        returns those rows' (source, drafts), by row index. A row that may use several model
        drafters gets the one the policy chose (Request.drafter)."""
        if not any(r.params.auto_k and r.params.mode_spec.source for r in batch):
            return {}  # no row chooses: fixed k, or plain decoding (mode ar) whatever its k says
        fixed = [not req.params.auto_k or h is not None for req, h in zip(batch, held)]
        offers = {
            b: self._free_offer(row, self._room(req))
            for b, (req, row, f) in enumerate(zip(batch, rows, fixed))
            if not f and req.params.mode_spec.source == "model" and row.mla and row.k > 0
        }
        choices = [self._choices(req, h) for req, h in zip(batch, held)]
        infos = [
            RowInfo(
                row.key,
                row.k,
                req.params.mode_spec.source or NONE,
                fixed=f,
                free_k=len(offers.get(b, (None, []))[1]),
                free_strong=b in offers and (offers[b][0] != "pld" or self.free_lookup.strong_match(offers[b][2])),
                free_match=offers[b][2] if b in offers else 0,
                drafter_lag=self._lag(req, req.drafter or self.default_drafter),
                remaining=self._room(req) + 1,
                drafter=req.drafter,
                drafters=choices[b],
                drafter_lags=tuple(self._lag(req, name) for name in choices[b]),
            )
            for b, (req, row, f) in enumerate(zip(batch, rows, fixed))
        ]
        ks = self.policy.choose(infos)
        free = {}
        for b, (req, row, k, f) in enumerate(zip(batch, rows, ks, fixed)):
            if self.policy.drafter_of[b] is not None:
                req.drafter = self.policy.drafter_of[b]
            if f:
                continue
            row.k, row.min_confidence = k, self.policy.min_confidence(self.policy.key_of(row.key, req.drafter))
            if self.policy.free[b] and k > 0:
                free[b] = (offers[b][0], offers[b][1][:k])
            elif req.stats.rounds == 0 and req.params.mode_spec.source == "model":
                # The round that prefills the prompt: a model draft would first have the drafter
                # prefill the whole prompt too, and the first token would wait for it (the TTFT
                # of plain decoding is the promise); the drafter catches up when the row next
                # drafts. Its free drafts (above) and a model-free mode's draft as usual.
                row.k = 0
        return free

    def _choices(self, req: Request, held: Ahead | None) -> tuple[str, ...]:
        """The drafters k auto may choose a row's among: every one but those in their backoff
        after a failure (drafter_backoff.py; all of them if every one is), unless the request
        names one or its drafts were made ahead (by the default drafter)."""
        if req.params.drafter is not None or held is not None or len(self.drafter_names) < 2:
            return ()
        down = self.drafter_backoff.down()
        return tuple(n for n in self.drafter_names if n not in down) or self.drafter_names

    @staticmethod
    def _lag(req: Request, name: str | None) -> int:
        """Tokens the named drafter must prefill before it drafts the row: those committed since
        it last drafted it (all of them if it never did)."""
        return len(req.tokens) - req.drafter_seen.get(name, 0)

    def _free_offer(self, row: Row, room: int) -> tuple[str | None, list[int], int]:
        """Up to row.k drafts from the row's first MLA source that proposes any (drafters.py),
        with the source's name and, for prompt lookup, its match's length: a copy under way may
        offer up to lookup_match.COPY_K drafts, within the row's room."""
        sources = {"suffix": self.suffix_index, "recycle": self.recycler}
        tokens = RowTokens.of(row)
        for name in row.mla_sources:
            if name == "pld":  # the most a copy could carry, cut to what its match allows
                got, match = self.free_lookup.offer(tokens, offer_width(row.k, room, MATCH_CAP), MATCH_CAP)
                if got:
                    return name, got[: offer_width(row.k, room, match)], match
                continue
            got = sources[name].propose(tokens, row.k)
            if got:
                return name, got, 0
        return None, [], 0

    def _row(self, req: Request) -> Row:
        p = req.params
        k = 0 if p.mode_spec.source is None else max(0, min(p.k_cap, self._room(req)))
        entropy = p.entropy if p.mode_spec.loose and p.theta < 1 else None
        rho = float(p.rho) if entropy else 0.0
        grammar = RowGrammar(req.matcher.text, req.n_prompt) if req.matcher is not None else None
        return Row(
            req.id,
            req.tokens,
            k,
            p.mla,
            p.temperature,
            p.top_p,
            req.seed,
            entropy,
            rho=rho,
            row_share=self.policy.row_share(),
            mla_sources=p.mla_levels,
            grammar=grammar,
            chat=req.chat,
            cross_vocab=p.cross_vocab,
        )

    def _draft(
        self, batch: list[Request], rows: list[Row], held: list[Ahead | None], free: dict[int, tuple]
    ) -> tuple[Drafts, bool]:
        """Drafts for every row, and whether the model drafter failed this round. Its compute
        seconds, where a remote drafter reports them, ride along (Drafts.compute_s). A failed
        drafter's rows get prompt-lookup drafts (exact at any temperature: a one-hot q), and the
        next round tries the drafter again: rows carry all their tokens, so they never depend on it.
        Its rows' drafts count as prompt lookup's (added to `free`: k auto learns them, and the
        stats show them, as lookup drafts, not the drafter's), and the drafter is left out of k
        auto's choice for a while (drafter_backoff.py)."""
        drafts, fallback = Drafts.empty(len(rows)), False
        groups: dict[tuple[str, str | None], list[int]] = {}  # (kind, model drafter) -> its rows
        for b, r in enumerate(batch):
            kind = r.params.mode_spec.source
            if kind and rows[b].k and held[b] is None and b not in free:
                name = (r.drafter or self.default_drafter) if kind == "model" else None
                groups.setdefault((kind, name), []).append(b)
        for (kind, name), idx in groups.items():
            drafter = self.model_drafter(name) if kind == "model" else self.drafters[kind]
            try:
                if drafter is self.drafters["model"]:  # with draft-ahead, on the drafter's thread (its budget)
                    got = self.pipeline.draft(drafter.propose, [rows[b] for b in idx])
                else:
                    got = drafter.propose([rows[b] for b in idx])
            except Exception:
                if kind != "model":  # the model-free sources run here: their failure is a bug
                    raise
                log.warning("drafter %s failed; prompt lookup drafts its rows this round", name, exc_info=True)
                fallback = True
                self.drafter_backoff.failed(name)
                got = self.drafters["pld"].propose([rows[b] for b in idx])
                got.forwards = 0
                kind = "fallback"
                free.update((b, ("pld", got.tokens[i])) for i, b in enumerate(idx))
            for i, b in enumerate(idx):
                drafts.tokens[b], drafts.q[b] = got.tokens[i], got.q[i]
            if kind == "model":  # the forwards k "auto" costs and learns MLA from
                self.drafter_backoff.succeeded(name)
                for b in idx:
                    batch[b].drafter_seen[name] = len(batch[b].tokens)
                drafts.forwards += got.forwards
                if got.compute_s is not None:
                    drafts.compute_s = (drafts.compute_s or 0.0) + got.compute_s
                drafts.prefix_hit_tokens = _spread(drafts.prefix_hit_tokens, len(rows), idx, got.prefix_hit_tokens)
                drafts.row_forwards = _spread(drafts.row_forwards, len(rows), idx, got.row_forwards)
        for b, (_, d) in free.items():  # proposed by the row's model-free sources (_choose_ks): q one-hot
            drafts.tokens[b] = d
        ahead = [b for b, a in enumerate(held) if a is not None]  # made while the last round was verified
        for b in ahead:
            drafts.tokens[b], drafts.q[b] = held[b].drafts, held[b].q
            batch[b].drafter_seen[self.default_drafter] = len(batch[b].tokens)
        reported = [b for b in ahead if held[b].forwards is not None]
        drafts.row_forwards = _spread(drafts.row_forwards, len(rows), reported, [held[b].forwards for b in reported])
        self._constrain(batch, drafts)
        return drafts, fallback

    @staticmethod
    def _constrain(batch: list[Request], drafts: Drafts) -> None:
        """Structured output: cut each constrained row's drafts at the first token its grammar
        refuses and give the scorer the grammar's masks along what is left. A deterministic
        proposal (q one-hot) is cut before the refused token: the target's masked p gives it 0,
        so verifying it would only reject it and draw from p, what the bonus position draws
        anyway. A sampled proposal (q a distribution) keeps the refused token as its last draft:
        its sure rejection draws from the residual (p - q)+, which is what keeps speculative
        sampling exact; drawing from p there instead would not be."""
        if not any(r.matcher for r in batch):
            return
        drafts.masks = [None] * len(batch)
        for b, req in enumerate(batch):
            if req.matcher is None:
                continue
            d, q = drafts.tokens[b], drafts.q[b]
            legal, masks = req.matcher.plan(d)
            keep = legal + 1 if legal < len(d) and q is not None else legal
            req.stats.grammar_cut += len(d) - legal  # drafts the grammar refused (and those after them)
            drafts.tokens[b] = d[:keep]
            if q is not None and keep < q.shape[0]:
                drafts.q[b] = q.narrow_copy(0, 0, keep)
            drafts.masks[b] = masks

    def _recycle(self, rows: list[Row], drafts: Drafts, verdict) -> None:
        """Feed the target's top-k at every position it verified, [last token, d_1..d_n] per row,
        to the token recycler (rejected drafts too: what follows a token is learned whatever
        the context, Token Recycling's "trash")."""
        if verdict.topk is None:
            return
        if not any(drafts.tokens):  # an ar step: one position a row
            self.recycler.observe([row.tokens[-1] for row in rows], verdict.topk[:, 0])
            return
        fed = [t for row, d in zip(rows, drafts.tokens) for t in (row.tokens[-1], *d)]
        n = torch.tensor([len(d) + 1 for d in drafts.tokens])
        verified = torch.arange(verdict.topk.shape[1])[None, :] < n[:, None]  # [B, K+1], row-major as fed
        self.recycler.observe(fed, verdict.topk[verified])

    def _decide(self, batch: list[Request], drafts: Drafts, verdict):
        if not any(drafts.tokens):  # an ar step (k 0 everywhere): nothing to decide
            return torch.zeros(len(batch), dtype=torch.long), torch.zeros(len(batch), 0, dtype=torch.bool)
        n = torch.tensor([len(d) for d in drafts.tokens])
        theta = torch.tensor([r.params.theta if r.params.mode_spec.loose else 1.0 for r in batch])
        check, span = zip(*(window_positions(r.params.effective_window, r.params.window_rule) for r in batch))
        guard = self._plausible(batch, verdict)
        return decide(verdict.ok, verdict.h, n, theta, torch.tensor(check), torch.tensor(span), verdict.support, guard)

    @staticmethod
    def _plausible(batch: list[Request], verdict) -> torch.Tensor | None:
        """The plausibility guard [B, K] of rows with rho > 0 (None: no row has one). A scorer
        that reports no ratio leaves those rows strict: a guard asked for is never skipped."""
        rho = [float(r.params.rho) if r.params.mode_spec.loose else 0.0 for r in batch]
        if not any(rho):
            return None
        rho = torch.tensor(rho)
        if verdict.plausibility is None:
            return (rho == 0)[:, None].expand_as(verdict.ok)
        return plausible_mask(verdict.plausibility, rho)

    def _commit(self, req: Request, new: list[int]) -> int:
        """Append a round's tokens, applying EOS, max_tokens and stop strings; returns how many."""
        p = req.params
        new = new[: p.max_tokens - req.n_generated]
        for i, t in enumerate(new):
            if t in self.eos_ids:
                new, req.finish_reason = new[:i], "stop"
                break
        if req.matcher is not None:  # first: a token it refuses fails the request before the row changed
            try:
                req.matcher.accept(new)
            except GrammarFailed as e:  # the grammar library gave up midway: this request alone ends
                req.finish_reason, req.error = "error", str(e)
                return 0
            if req.matcher.done and not req.finished:  # nothing but EOS can follow
                req.finish_reason = "stop"
        req.tokens.extend(new)
        req.stats.emitted += len(new)
        searched = len(req.text)  # text already searched for stop strings
        req.text += req.detokenizer.add(new)
        if req.finished or req.n_generated >= p.max_tokens:
            req.text += req.detokenizer.flush()
        cut = find_stop(req.text, p.stop, searched)
        if cut is not None:
            req.text, req.finish_reason = req.text[:cut], "stop"
        if not req.finished and req.n_generated >= p.max_tokens:
            req.finish_reason = "length"
        return len(new)

    def _retire(self):
        finished = [r for r in self.running if r.finished]
        if not finished:
            return
        done = [r.id for r in finished]
        self.running = [r for r in self.running if not r.finished]
        self.pipeline.forget(done)
        self.lookups.release(done)
        for req in finished:
            if req.finish_reason != "error":  # an aborted output is still the target's text
                self.suffix_index.add(req.tokens)
        self.policy.release(done)
        for part, keys in self._holders(finished):
            try:  # a cache on a dead or replaced replica is gone anyway; LRU reclaims the rest
                part.release(keys)
            except Exception:
                log.warning("release of %d finished rows failed", len(keys), exc_info=True)

    def _holders(self, finished: list[Request]) -> list[tuple[object, list[str]]]:
        """Each part that may hold state of these finished rows, with their keys: the target and
        the model-free sources every row; a model drafter only the rows it drafted
        (Request.drafter_seen), the default one with draft-ahead every row (a bet drafts a row
        that drafted otherwise this round). A drafter pool the rows never reached is not called."""
        done = [r.id for r in finished]
        out = [(part, done) for part in (self.scorer, *(self.drafters[k] for k in ("pld", "suffix", "recycle")))]
        ahead = self.pipeline.stages is not None
        for name in self.drafter_names:
            keys = [r.id for r in finished if name in r.drafter_seen or (ahead and name == self.default_drafter)]
            if keys:
                out.append((self.model_drafter(name), keys))
        return out
