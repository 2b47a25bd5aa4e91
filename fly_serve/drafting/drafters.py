"""Drafters (contracts.Drafter): each proposes up to row.k tokens per row. A sampled row's drafts
are keyed draws (sampling.py: the target draws with the same numbers and compares tokens), so
no q is shipped (Drafts.q None).

SourceDrafter  a model-free source (contracts.DraftSource) alone: its proposals are deterministic,
  so q is one-hot (None) and speculative sampling stays exact at any temperature.
  Sources: PromptLookup (the row's own tokens), suffix_index.SuffixIndex (earlier requests of the
  engine), token_recycling.TokenRecycling (the target's own earlier top-k).
LookupDrafter  SourceDrafter over prompt lookup (the `pld` mode).
ModelDrafter  a small model with its own KV cache. With MLA (multi-level acceleration) each
  drafter forward also checks a proposal of a model-free source, exactly as the target checks
  drafts, so one forward can advance several tokens; without one it advances one. The row names
  the sources (Row.mla_sources) in order and the first that proposes anything is used: one
  proposal per forward keeps the forward's width (its cost) at most k, and the order puts the
  likeliest-right source first (the row's own text, then earlier requests, then the recycled
  top-1 chain, which nearly always proposes something). The drafter verifies whichever it uses,
  so its output distribution, and the target's output, never depend on the source.
  In a batch, a proposal widens the shared forward and saves a forward only if every row's holds,
  so where a forward costs by its width (a CPU) a batch's proposals are mostly a loss: a forward
  carries its greedy rows' proposals only where they pay (lookups_pay, from the row's own history
  of kept proposals and the cost profile's price of a row, Row.row_share).
  Structured output (a row with Row.grammar): the drafter drafts under the row's grammar, its
  logits masked at every position by the grammar's state after the tokens drafted so far
  (grammar.DraftMatchers), so greedy drafts are legal and a sampled draft's q is the masked
  distribution it was drawn from. Where the grammar forces tokens (a schema's keys, quotes and
  braces) they lead the forward's proposal (one tokenization of the forced bytes; the mask may
  allow another, such as `{` besides `{"`), so the drafter checks them all, as any proposal, in
  the forward that drafts the token after them.
  Draft-ahead (a row with Row.peek, draft_ahead.py): the drafter first takes its own next token
  (its argmax: no random draw) and drafts after it. Those drafts bet on the target's verdict; a
  sampled row's draws are keyed by position, so a lost bet leaves no trace in its later drafts.
  Two draft loops (draft_loop): the MLA loop above, and on a GPU the fixed-shape loop
  (fixed_loop.py: one-token steps, no host read inside, every step a CUDA graph's replay) for
  the rows it can take (unconstrained, not peeking); both draft the same tokens for a row
  without MLA proposals.
"""

import math
from dataclasses import replace

import torch

from fly_serve.contracts import Drafts, DraftSource, ModelRunner, Row, RowTokens
from fly_serve.decision.grammar import DraftMatchers, Grammars, Matcher, apply_masks
from fly_serve.decision.sampling import RowKeys, keyed_draw, probs_rows
from fly_serve.decision.verify import decide, greedy_check, padded
from fly_serve.decision.vocab_reads import argmax, top_prob

from . import prompt_lookup
from .fixed_loop import FixedLoop


def lookups_pay(kept: list[float | None], share: float) -> bool:
    """Whether a batched drafter forward should carry its rows' lookup proposals.

    kept: per row of the forward, the chance that its proposal's first token holds (None: the row
    has no proposal); share: a row's seconds in a forward over the forward's own (the cost
    profile's per_row_forward / per_forward). Counted in forwards: each proposal's first token
    widens the forward by `share`; where it holds, its row needs one row-forward less later (share
    back), and only where every row's holds does the batch need one forward less (1). So they
    pay iff

        prod(kept) >= share x sum over proposing rows of (1 - kept_b).

    Alone that is kept >= share / (1 + share): nearly always. In a batch on a CPU, where a row
    costs a sizable share of a forward, one row without a proposal makes them a loss; where width
    is free (share 0, a GPU's forward) they ride at any batch."""
    all_hold = math.prod(q or 0.0 for q in kept)
    return all_hold >= share * sum(1 - q for q in kept if q is not None)


def stopping(confidence: list[float], floor: list[float]) -> set[int]:
    """The rows of a batched drafter forward that stop drafting after it: those with a floor
    (a greedy row's min_confidence; 0: it drafts its k) stop together, when their confidences in
    the token just drafted add up to less than their floors.

    Together, because the rows share what a draft costs: the drafter's forward runs while any row
    drafts, and the target verifies every row padded to the widest. A row that stops alone saves
    neither and gives up drafts that the others' width verifies for free (a stop by row took more
    rounds for the same tokens and ran slower: docs/journal.md). The floors are priced per row
    (SpeculationPolicy.min_confidence: the round's rate times a row's share of one more draft), so
    the batch's next forward pays when the chances sum to the floors.
    A row alone is the rule it always was: it stops once its own confidence falls below its floor.
    """
    judged = [b for b, f in enumerate(floor) if f > 0]
    if sum(confidence[b] for b in judged) < sum(floor[b] for b in judged):
        return set(judged)
    return set()


class PromptLookup:
    """Prompt lookup as a DraftSource. A row given as a contracts.RowTokens with a key is answered
    from that key's incremental index (prompt_lookup.LookupIndexes, shared where given), the same
    answer as a scan of its whole tokens, in O(new tokens)."""

    def __init__(self, max_n: int = 4, min_n: int = 1, indexes: prompt_lookup.LookupIndexes | None = None):
        self.max_n, self.min_n = max_n, min_n
        self.indexes = indexes if indexes is not None else prompt_lookup.LookupIndexes(max(max_n, 4))

    def propose(self, tokens: list[int], k: int, min_n: int | None = None) -> list[int]:
        """min_n: this call's shortest match (default the source's own)."""
        min_n = self.min_n if min_n is None else min_n
        key = getattr(tokens, "key", None)
        if key is None or k <= 0:
            return prompt_lookup.propose(tokens, k, self.max_n, min_n)
        return self.indexes.of(key, tokens, tokens.final).propose(tokens, k, self.max_n, min_n)

    def offer(self, tokens: list[int], k: int, cap: int) -> tuple[list[int], int]:
        """propose(tokens, k) and how far its match reaches back (prompt_lookup.match_length, at
        most cap tokens; 0: no proposal)."""
        if k <= 0:
            return [], 0
        key = getattr(tokens, "key", None)
        if key is None:
            end = prompt_lookup.find(tokens, self.max_n, self.min_n)
        else:
            end = self.indexes.of(key, tokens, tokens.final).find(tokens, self.max_n, self.min_n)
        if end is None:
            return [], 0
        return list(tokens[end + 1 : end + 1 + k]), prompt_lookup.match_length(tokens, end, cap)

    def strong(self, tokens: list[int]) -> bool:
        """Whether the last max_n tokens occurred before: the match whose drafts are kept far more
        often than a shorter one's (docs/journal.md, "Probes on a strong match")."""
        return self.strong_match(self.offer(tokens, 1, self.max_n)[1])

    def strong_match(self, match: int) -> bool:
        """Whether an offer whose match reaches `match` tokens back (offer) is a strong one."""
        return match >= self.max_n

    def release(self, keys: list[str]) -> None:
        self.indexes.release(keys)


class SourceDrafter:
    """A model-free source as a Drafter: up to row.k tokens per row, q one-hot (None)."""

    def __init__(self, source: DraftSource):
        self.source = source

    def propose(self, rows: list[Row]) -> Drafts:
        return Drafts([self.source.propose(RowTokens.of(r), r.k) for r in rows], [None] * len(rows))

    def release(self, keys: list[str]) -> None:
        # a shared source learns from finished requests, not rows; prompt lookup's index goes
        release = getattr(self.source, "release", None)
        if release is not None:
            release(keys)

    def share_sources(self, sources: dict[str, DraftSource]) -> None:
        pass  # one source of its own; no MLA levels

    def share_grammars(self, grammars: Grammars) -> bool:
        return False  # proposals as they come; the engine cuts them at the first refused token


class LookupDrafter(SourceDrafter):
    def __init__(self, max_n: int = 4, min_n: int = 1, indexes: prompt_lookup.LookupIndexes | None = None):
        super().__init__(PromptLookup(max_n, min_n, indexes))


LOOPS = ("auto", "mla", "fixed")


def draft_loop(requested: str, runner: ModelRunner) -> str:
    """The draft loop a ModelDrafter runs: "mla" (one forward may advance several tokens, host
    work between forwards: for a CPU, where a forward costs far more than the host's work around
    it) or "fixed" (fixed_loop.py: one-token steps on static shapes with no host read inside,
    each step a CUDA graph's replay: for a GPU, where the host's work costs more than a replayed
    forward). auto: fixed on a CUDA device, mla elsewhere; the fixed loop needs the torch runtime."""
    if requested not in LOOPS:
        raise ValueError(f"draft_loop: must be one of {', '.join(LOOPS)} (got {requested!r})")
    capable = FixedLoop.runs_on(runner)
    if requested == "fixed" and not capable:
        raise ValueError("draft_loop: 'fixed' needs the torch runtime's runner (runner.Runner), not this one")
    if requested == "auto":
        return "fixed" if capable and torch.device(runner.device).type == "cuda" else "mla"
    return requested


class ModelDrafter:
    def __init__(
        self,
        runner: ModelRunner,
        max_n: int = 4,
        min_n: int = 1,
        min_confidence: float = 0.0,
        vocab_size: int | None = None,
        loop: str = "auto",
    ):
        """runner: the draft model with its KV cache (contracts.ModelRunner); loop: draft_loop's."""
        self.runner = runner
        self.kv_capacity_tokens = runner.cache.capacity_tokens
        # MLA levels by name (params.MLA_SOURCES); the engine shares its suffix index, token
        # recycler and prompt lookup index here (share_sources), so a standalone drafter has its
        # own prompt lookup only.
        self.sources: dict[str, DraftSource] = {"pld": PromptLookup(max_n, min_n)}
        # A greedy row stops drafting once the drafter's own probability of its token falls
        # below this: the tokens after it would mostly be thrown away (0: always draft k).
        self.min_confidence = min_confidence
        # The tokens the tokenizer knows (model_scorer.py cuts the target's logits the same way),
        # so q has the target's width and no padding row of a wider head is ever drafted.
        self.vocab_size = vocab_size or runner.vocab_size
        # Sampled rows draw keyed (sampling.keyed_draw): the target draws with the same numbers,
        # so no q travels, and a bet's drafts (draft-ahead) leave no state behind.
        self.keys = RowKeys()
        self.loop = draft_loop(loop, runner)
        self.fixed = FixedLoop(runner, self.vocab_size, self.keys) if self.loop == "fixed" else None
        self.matchers: DraftMatchers | None = None  # structured output (share_grammars)
        self.forwards = 0  # drafter forwards, all rows together, since start
        # per row: [proposals whose first token held, proposals] (lookups_pay), from a prior of 1 in 2
        self.proposals_kept: dict[str, list[int]] = {}
        self.hits = 0  # rows whose KV cache this drafter already held (session affinity)
        self.misses = 0
        # Rows whose logits are limited (a drafter of another vocabulary drafting by TLI:
        # cross_vocab.py): key -> an additive mask [V], 0 where a token may be drafted, -inf
        # elsewhere, applied before any read of the logits (drafts, q, MLA's checks, the stop).
        self.limits: dict[str, torch.Tensor] = {}
        # What its sampled draws are keyed by (sampling.keyed_draw): None, its own token ids and
        # positions; a drafter of another vocabulary sets the target's ids of its tokens (token
        # keys [V]) and, per row, the target position of its next token less its own, so that its
        # draws and the target's use the same numbers (cross_vocab.py: TLI at T > 0).
        self.token_keys: torch.Tensor | None = None
        self.position_shift: dict[str, int] = {}

    def cache_report(self) -> dict:
        """How often a row found its KV cache here warm, and the forwards since start (stats)."""
        seen = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / seen if seen else 0.0,
            "forwards": self.forwards,
            "prefix_hit_tokens": self.runner.cache.hit_tokens_total,
        }

    def share_sources(self, sources: dict[str, DraftSource]) -> None:
        """Add (or replace) MLA sources by name, e.g. the engine's suffix index and recycler."""
        self.sources.update(sources)

    def share_grammars(self, grammars: Grammars) -> bool:
        """Draft constrained rows under their grammar, with this grammar side's tokenizer."""
        self.matchers = DraftMatchers(grammars)
        return True

    def propose(self, rows: list[Row]) -> Drafts:
        cache = self.runner.cache
        views = [RowTokens.of(r) for r in rows]
        held = [cache.valid(r.key, v) for r, v in zip(rows, views)]  # each row's tokens its cache holds
        warm = sum(h > 0 for h in held)
        self.hits += warm
        self.misses += len(rows) - warm
        matchers = []
        try:
            for r in rows:  # inside the try: a failure at row j leaves rows < j pushed otherwise
                matchers.append(self.matchers.at(r) if self.matchers else None)
            rows, guesses, drafts, forwards, row_forwards = self._draft(rows, views, held, matchers)
        finally:  # each matcher back at its row's committed tokens
            for m in matchers:
                if m is not None:
                    m.pop()
        hits = self.runner.cache.take_hits([r.key for r in rows])  # prefill the prefix cache saved
        return Drafts(drafts, [None] * len(rows), forwards, row_forwards, guesses=guesses, prefix_hit_tokens=hits)

    def _draft(self, rows: list[Row], views: list[RowTokens], held: list[int], matchers: list[Matcher | None]):
        """The drafting forwards of a call: (rows, guesses, drafts, forwards, row_forwards). The
        fixed-shape loop takes the rows it can (unconstrained, not peeking, not limited), the MLA
        loop the rest."""
        drafts = [[] for _ in rows]
        row_forwards = [0] * len(rows)
        forwards = 0
        fixed = []
        if self.fixed is not None:
            # a limited row (TLI) keeps to the MLA loop, which applies its mask before every read
            fixed = [
                b
                for b, (r, m) in enumerate(zip(rows, matchers))
                if r.k > 0 and m is None and not r.peek and r.key not in self.limits
            ]
        if fixed:
            sub = [rows[b] for b in fixed]
            got, forwards = self.fixed.draft(sub, [views[b] for b in fixed], [held[b] for b in fixed], self._floors)
            self.forwards += forwards
            for b, d in zip(fixed, got):
                drafts[b], row_forwards[b] = d, len(d)
        taken = set(fixed)
        rest = [b for b in range(len(rows)) if b not in taken]
        if not rest:
            return rows, None, drafts, forwards, row_forwards
        sub = [rows[b] for b in rest]
        # After a round whose drafts all passed, the drafter lacks d_K and the bonus token: a lag
        # of two, fed in the first drafting forward rather than a forward of its own.
        self.runner.catch_up([r.key for r in sub], [views[b] for b in rest], max_lag=4)
        sub, guesses, got, n_forwards, got_row_forwards = self._mla(sub, [matchers[b] for b in rest])
        out_rows = list(rows)
        for i, b in enumerate(rest):
            out_rows[b], drafts[b], row_forwards[b] = sub[i], got[i], got_row_forwards[i]
        if guesses is not None:
            spread = [None] * len(rows)
            for i, b in enumerate(rest):
                spread[b] = guesses[i]
            guesses = spread
        return out_rows, guesses, drafts, forwards + n_forwards, row_forwards

    def _mla(self, rows: list[Row], matchers: list[Matcher | None]):
        """The MLA loop: (rows, guesses, drafts, forwards, row_forwards)."""
        guesses = None
        if any(r.peek for r in rows):
            rows, guesses = self._peek(rows, matchers)
        drafts = [[] for _ in rows]
        active = [b for b, r in enumerate(rows) if r.k > 0]
        forwards, row_forwards = 0, [0] * len(rows)
        while active:
            ms = [matchers[b] for b in active]
            stop = self._step([rows[b] for b in active], [drafts[b] for b in active], ms)
            for b in active:
                row_forwards[b] += 1
            active = [b for i, b in enumerate(active) if len(drafts[b]) < rows[b].k and i not in stop]
            forwards += 1
        return rows, guesses, drafts, forwards, row_forwards

    def _floors(self, rows: list[Row]) -> list[float]:
        """Each row's confidence floor (0: drafts its k): greedy rows only (stopping)."""
        return [0.0 if r.sampled else max(self.min_confidence, r.min_confidence) for r in rows]

    def _peek(self, rows: list[Row], matchers: list[Matcher | None]) -> tuple[list[Row], list[int | None]]:
        """Each peeking row's tokens extended by the drafter's own next token, in one batched
        forward. Its argmax: the likeliest value of the target's bonus token; a constrained
        row's among what its grammar allows (its matcher then takes it; after an EOS the row
        drafts nothing). A bet's drafts are keyed draws (sampling.py), so a lost bet leaves
        nothing to rewind."""
        idx = [b for b, r in enumerate(rows) if r.peek]
        views = [RowTokens.of(rows[b]) for b in idx]
        logits, _ = self.runner.feed([rows[b].key for b in idx], views, tail=[1] * len(idx))
        self.forwards += 1
        logits = logits[:, :1, : self.vocab_size]  # [len(idx), 1, V]
        self._limit([rows[b] for b in idx], logits)
        if any(matchers[b] for b in idx):
            apply_masks(logits, [matchers[b].mask()[None] if matchers[b] else None for b in idx])
        nxt = argmax(logits[:, 0]).tolist()  # [len(idx)]
        out, guesses = list(rows), [None] * len(rows)
        for b, t in zip(idx, nxt):
            k = rows[b].k if matchers[b] is None or matchers[b].push([t]) else 0
            # the guess joins the tokens the row bets on (guessed: not committed)
            guesses[b], out[b] = (
                t,
                replace(rows[b], tokens=rows[b].tokens + [t], peek=False, k=k, guessed=rows[b].guessed + 1),
            )
        return out, guesses

    def _step(self, rows: list[Row], drafts: list[list[int]], matchers: list[Matcher | None]) -> set[int]:
        """One batched drafter forward: each row feeds its last token plus a lookup proposal and
        keeps the proposal's verified prefix and the drafter's next token (extends drafts).
        A sampled row's tokens are its keyed draws (sampling.keyed_draw): a proposal token holds
        where it equals the draw, so its drafts are exactly those it would draft without MLA.
        A constrained row's logits are masked by its grammar along the proposal, and its matcher
        takes the tokens kept. Returns the rows that stop: their new token fell below
        min_confidence, or a constrained row drafted EOS."""
        contexts = [RowTokens.of(r, d) for r, d in zip(rows, drafts)]
        proposals, masks = [], []
        for c, r, d, m in zip(contexts, rows, drafts, matchers):
            p, mask = self._proposal(r, c, r.k - len(d) - 1, m)
            proposals.append(p)
            masks.append(mask)
        proposals = self._carried(rows, proposals, matchers)
        fed = [RowTokens(c.base, list(c.extra) + p, c.final) for c, p in zip(contexts, proposals)]
        logits, _ = self.runner.feed([r.key for r in rows], fed, tail=[1 + len(p) for p in proposals])
        logits = logits[..., : self.vocab_size]
        self._limit(rows, logits)
        if any(m is not None for m in masks):  # every later read (argmax, draws, confidence) is the masked one
            apply_masks(logits, masks)
        self.forwards += 1
        proposed, n = padded(proposals)
        ok, y = greedy_check(logits, proposed, n)
        sampled = [b for b, r in enumerate(rows) if r.sampled]
        if sampled:
            draws = self._draws([rows[b] for b in sampled], [len(contexts[b]) for b in sampled], logits[sampled])
            y[sampled] = draws
            K = proposed.shape[1]
            ok[sampled] = (proposed[sampled] == draws[:, :K]) & (torch.arange(K)[None, :] < n[sampled, None])
        none = torch.zeros(len(rows), dtype=torch.long)
        accept_len, _ = decide(ok, None, n, theta=torch.ones(len(rows)), check=none)
        unsure = set()
        floor = self._floors(rows)
        if any(floor):
            last = logits[torch.arange(len(rows)), accept_len.to(logits.device)]
            unsure = stopping(top_prob(last).tolist(), floor)
        for b, (r, a) in enumerate(zip(rows, accept_len.tolist())):
            if proposals[b]:
                tally = self.proposals_kept.setdefault(r.key, [1, 2])
                tally[0], tally[1] = tally[0] + (a > 0), tally[1] + 1
            new = proposals[b][:a] + [int(y[b, a])]
            room = r.k - len(drafts[b])
            drafts[b].extend(new[:room])
            if matchers[b] is not None and matchers[b].push(new[:room]) < len(new[:room]):
                unsure.add(b)  # an EOS (the mask allows nothing else it could refuse): nothing follows
        return unsure

    def _limit(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Each limited row's logits [B, T, V] plus its mask (self.limits), in place."""
        with torch.inference_mode():  # the runner's logits are inference tensors
            for b, r in enumerate(rows):
                mask = self.limits.get(r.key)
                if mask is not None:
                    logits[b] += mask

    def _draws(self, rows: list[Row], lengths: list[int], logits: torch.Tensor) -> torch.Tensor:
        """[R, T] on the host: each sampled row's keyed draw at each fed position (logits [R, T, V],
        position i of row r predicts its token at r.start + lengths[r] + i)."""
        T = logits.shape[1]
        p = probs_rows(logits, rows)
        shift = self.position_shift
        first = torch.tensor([r.start + n + shift.get(r.key, 0) for r, n in zip(rows, lengths)], dtype=torch.long)
        positions = (first[:, None] + torch.arange(T)[None, :]).reshape(-1).to(logits.device)
        keys = self.keys.tensor(rows, T, logits.device)
        drawn = keyed_draw(p.reshape(-1, p.shape[-1]), keys, positions, self.token_keys)
        return drawn.view(len(rows), T).cpu()

    def _carried(self, rows: list[Row], proposals: list[list[int]], matchers: list[Matcher | None]) -> list[list[int]]:
        """The proposals a forward carries: all of them, or where they do not pay (lookups_pay)
        none of its greedy unconstrained rows'. A sampled row's draws follow its proposals, so they
        never depend on its batch; a constrained row's lead with the tokens its grammar forces."""
        share = rows[0].row_share if rows else None
        if share is None or not any(proposals):
            return proposals
        kept = [self._kept(r.key) if p else None for r, p in zip(rows, proposals)]
        if lookups_pay(kept, share):
            return proposals
        return [p if r.sampled or m is not None else [] for r, p, m in zip(rows, proposals, matchers)]

    def _kept(self, key: str) -> float:
        """The row's share of proposals whose first token held (lookups_pay)."""
        held, made = self.proposals_kept.get(key, (1, 2))
        return held / made

    def _proposal(
        self, row: Row, context: list[int], room: int, m: Matcher | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """A forward's proposal and, for a constrained row, its grammar's masks at the positions
        0..len fed [len + 1, W]: the tokens the grammar forces, then the MLA proposal after them,
        cut before the first token the grammar refuses (or an EOS: nothing is drafted after one)."""
        if m is None:
            return self._mla_proposal(row, context, room), None
        forced = m.forced()[: max(room, 0)]
        proposal = forced + self._mla_proposal(row, context + forced, room - len(forced))
        legal, masks = m.plan(proposal[: m.until_eos(proposal)])
        return proposal[:legal], masks[: legal + 1]

    def _mla_proposal(self, row: Row, context: list[int], room: int) -> list[int]:
        """Up to `room` tokens from the row's first MLA source that proposes any (module docstring)."""
        if not row.mla or room <= 0:
            return []
        for name in row.mla_sources:
            source = self.sources.get(name)
            got = source.propose(context, room) if source is not None else []
            if got:
                return got[:room]
        return []

    def release(self, keys: list[str]) -> None:
        self.runner.release(keys)
        self.keys.release(keys)
        if self.matchers is not None:
            self.matchers.release(keys)
        for source in self.sources.values():
            release = getattr(source, "release", None)
            if release is not None:  # prompt lookup's per-row index (not the shared learned sources)
                release(keys)
        for key in keys:
            self.proposals_kept.pop(key, None)
            self.limits.pop(key, None)
            self.position_shift.pop(key, None)
