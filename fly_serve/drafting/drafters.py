"""Drafters (contracts.Drafter): each proposes up to row.k tokens per row and, for sampling rows,
the distribution q each token was drawn from.

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
  (its argmax: no random draw) and drafts after it. Those drafts bet on the target's verdict;
  the row's random stream is snapshotted before them and rewound at its next call unless that
  call's tokens continue the bet (a hit), so a lost bet leaves no trace in the row's samples.
"""

import math
from dataclasses import replace

import torch

from fly_serve.contracts import Drafts, DraftSource, ModelRunner, Row
from fly_serve.decision.grammar import DraftMatchers, Grammars, Matcher, apply_masks
from fly_serve.decision.sampling import Generators, probs, speculative_row, wire_q
from fly_serve.decision.verify import decide, greedy_check, padded

from . import prompt_lookup


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
    """Prompt lookup as a DraftSource."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return prompt_lookup.propose(tokens, k, self.max_n, self.min_n)


class SourceDrafter:
    """A model-free source as a Drafter: up to row.k tokens per row, q one-hot (None)."""

    def __init__(self, source: DraftSource):
        self.source = source

    def propose(self, rows: list[Row]) -> Drafts:
        return Drafts([self.source.propose(r.tokens, r.k) for r in rows], [None] * len(rows))

    def release(self, keys: list[str]) -> None:
        pass  # no per-sequence state (a shared source learns from finished requests, not rows)

    def share_sources(self, sources: dict[str, DraftSource]) -> None:
        pass  # one source of its own; no MLA levels

    def share_grammars(self, grammars: Grammars) -> bool:
        return False  # proposals as they come; the engine cuts them at the first refused token


class LookupDrafter(SourceDrafter):
    def __init__(self, max_n: int = 4, min_n: int = 1):
        super().__init__(PromptLookup(max_n, min_n))


class ModelDrafter:
    def __init__(
        self,
        runner: ModelRunner,
        max_n: int = 4,
        min_n: int = 1,
        min_confidence: float = 0.0,
        vocab_size: int | None = None,
    ):
        """runner: the draft model with its KV cache (contracts.ModelRunner)."""
        self.runner = runner
        self.kv_capacity_tokens = runner.cache.capacity_tokens
        # MLA levels by name (params.MLA_SOURCES); the engine shares its suffix index and token
        # recycler here (share_sources), so a standalone drafter has prompt lookup only.
        self.sources: dict[str, DraftSource] = {"pld": PromptLookup(max_n, min_n)}
        # A greedy row stops drafting once the drafter's own probability of its token falls
        # below this: the tokens after it would mostly be thrown away (0: always draft k).
        self.min_confidence = min_confidence
        # The tokens the tokenizer knows (model_scorer.py cuts the target's logits the same way),
        # so q has the target's width and no padding row of a wider head is ever drafted.
        self.vocab_size = vocab_size or runner.vocab_size
        self.generators = Generators(salt=1, device=self.runner.device)  # sampling stays by the logits
        # per sampling row drafted ahead: (its generator's state before, the tokens a later call
        # must start with for those draws to stand; None until the ahead call finished)
        self.bets: dict[str, tuple[torch.Tensor, list[int] | None]] = {}
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
        self._settle_bets(rows)
        cache = self.runner.cache
        for r in rows:
            warm = cache.valid(r.key, r.tokens) > 0
            self.hits += warm
            self.misses += not warm
        # After a round whose drafts all passed, the drafter lacks d_K and the bonus token: a lag
        # of two, fed in the first drafting forward rather than a forward of its own.
        self.runner.catch_up([r.key for r in rows], [r.tokens for r in rows], max_lag=4)
        matchers = []
        try:
            for r in rows:  # inside the try: a failure at row j leaves rows < j pushed otherwise
                matchers.append(self.matchers.at(r) if self.matchers else None)
            rows, guesses, drafts, qs, forwards, row_forwards = self._draft(rows, matchers)
        finally:  # each matcher back at its row's committed tokens
            for m in matchers:
                if m is not None:
                    m.pop()
        q = [wire_q(torch.stack(q)) if rows[b].sampled and q else None for b, q in enumerate(qs)]  # [n, V]
        for b, g in enumerate(guesses or []):
            if g is not None and rows[b].key in self.bets:  # the bet stands if a later call continues it
                self.bets[rows[b].key] = (self.bets[rows[b].key][0], rows[b].tokens)
        hits = self.runner.cache.take_hits([r.key for r in rows])  # prefill the prefix cache saved
        return Drafts(drafts, q, forwards, row_forwards, guesses=guesses, prefix_hit_tokens=hits)

    def _draft(self, rows: list[Row], matchers: list[Matcher | None]):
        """The drafting forwards of a call: (rows, guesses, drafts, qs, forwards, row_forwards)."""
        guesses = None
        if any(r.peek for r in rows):
            rows, guesses = self._peek(rows, matchers)
        drafts = [[] for _ in rows]
        qs = [[] for _ in rows]
        active = [b for b, r in enumerate(rows) if r.k > 0]
        forwards, row_forwards = 0, [0] * len(rows)
        while active:
            ms = [matchers[b] for b in active]
            stop = self._step([rows[b] for b in active], [drafts[b] for b in active], [qs[b] for b in active], ms)
            for b in active:
                row_forwards[b] += 1
            active = [b for i, b in enumerate(active) if len(drafts[b]) < rows[b].k and i not in stop]
            forwards += 1
        return rows, guesses, drafts, qs, forwards, row_forwards

    def _peek(self, rows: list[Row], matchers: list[Matcher | None]) -> tuple[list[Row], list[int | None]]:
        """Each peeking row's tokens extended by the drafter's own next token, in one batched
        forward. Its argmax: the likeliest value of the target's bonus token, and no draw from the
        row's stream; a constrained row's among what its grammar allows (its matcher then takes
        it; after an EOS the row drafts nothing). A sampling row's stream is snapshotted here,
        before the drafts of the bet."""
        idx = [b for b, r in enumerate(rows) if r.peek]
        logits, _ = self.runner.feed([rows[b].key for b in idx], [rows[b].tokens for b in idx], tail=[1] * len(idx))
        self.forwards += 1
        logits = logits[:, :1, : self.vocab_size]  # [len(idx), 1, V]
        self._limit([rows[b] for b in idx], logits)
        if any(matchers[b] for b in idx):
            apply_masks(logits, [matchers[b].mask()[None] if matchers[b] else None for b in idx])
        nxt = logits[:, 0].argmax(-1).tolist()  # [len(idx)]
        out, guesses = list(rows), [None] * len(rows)
        for b, t in zip(idx, nxt):
            k = rows[b].k if matchers[b] is None or matchers[b].push([t]) else 0
            guesses[b], out[b] = t, replace(rows[b], tokens=rows[b].tokens + [t], peek=False, k=k)
            if rows[b].sampled:
                self.bets[rows[b].key] = (self.generators.get(rows[b]).get_state(), None)
        return out, guesses

    def _settle_bets(self, rows: list[Row]) -> None:
        """Rewind the stream of a row whose ahead drafts were not used, so the draws they took
        never happened for the sequence, exactly as drafting one round at a time draws. They were
        used only if the row's tokens now continue past the guess (its next round ran on them);
        tokens that leave the guess (a lost bet), tokens equal to it (the caller drafts that round
        again: its ahead call failed on the way back) and a call that never finished rewind."""
        for r in rows:
            bet = self.bets.pop(r.key, None)
            if bet is None:
                continue
            state, guess = bet
            if guess is None or len(r.tokens) <= len(guess) or r.tokens[: len(guess)] != guess:
                self.generators.get(r).set_state(state)

    def _step(
        self, rows: list[Row], drafts: list[list[int]], qs: list[list], matchers: list[Matcher | None]
    ) -> set[int]:
        """One batched drafter forward: each row feeds its last token plus a lookup proposal and
        keeps the proposal's verified prefix and the drafter's next token (extends drafts, qs).
        A constrained row's logits are masked by its grammar along the proposal, and its matcher
        takes the tokens kept. Returns the rows that stop: their new token fell below
        min_confidence, or a constrained row drafted EOS."""
        contexts = [r.tokens + d for r, d in zip(rows, drafts)]
        proposals, masks = [], []
        for c, r, d, m in zip(contexts, rows, drafts, matchers):
            p, mask = self._proposal(r, c, r.k - len(d) - 1, m)
            proposals.append(p)
            masks.append(mask)
        proposals = self._carried(rows, proposals, matchers)
        logits, _ = self.runner.feed(
            [r.key for r in rows], [c + p for c, p in zip(contexts, proposals)], tail=[1 + len(p) for p in proposals]
        )
        logits = logits[..., : self.vocab_size]
        self._limit(rows, logits)
        if any(m is not None for m in masks):  # every later read (argmax, q, confidence) is the masked one
            apply_masks(logits, masks)
        self.forwards += 1
        proposed, n = padded(proposals)
        ok, y = greedy_check(logits, proposed, n)
        for b, r in enumerate(rows):
            if r.sampled:  # drafts stay distributed as q: lookup proposals pass by speculative sampling
                p = probs(logits[b, : int(n[b]) + 1], r.temperature, r.top_p)
                ok[b], y[b] = speculative_row(p, proposed[b], int(n[b]), None, self.generators.get(r))
        none = torch.zeros(len(rows), dtype=torch.long)
        accept_len, _ = decide(ok, None, n, theta=torch.ones(len(rows)), check=none)
        unsure = set()
        floor = [0.0 if r.sampled else max(self.min_confidence, r.min_confidence) for r in rows]
        if any(floor):
            last = logits[torch.arange(len(rows)), accept_len.to(logits.device)]
            unsure = stopping(torch.softmax(last.float(), -1).max(-1).values.tolist(), floor)
        for b, (r, a) in enumerate(zip(rows, accept_len.tolist())):
            if proposals[b]:
                tally = self.proposals_kept.setdefault(r.key, [1, 2])
                tally[0], tally[1] = tally[0] + (a > 0), tally[1] + 1
            new = proposals[b][:a] + [int(y[b, a])]
            room = r.k - len(drafts[b])
            drafts[b].extend(new[:room])
            if matchers[b] is not None and matchers[b].push(new[:room]) < len(new[:room]):
                unsure.add(b)  # an EOS (the mask allows nothing else it could refuse): nothing follows
            if r.sampled:  # q goes to the verifier, maybe through Ray: host memory is its wire format
                qs[b].extend(probs(logits[b, : min(a + 1, room)], r.temperature, r.top_p).cpu())
        return unsure

    def _limit(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Each limited row's logits [B, T, V] plus its mask (self.limits), in place."""
        with torch.inference_mode():  # the runner's logits are inference tensors
            for b, r in enumerate(rows):
                mask = self.limits.get(r.key)
                if mask is not None:
                    logits[b] += mask

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
        self.generators.release(keys)
        if self.matchers is not None:
            self.matchers.release(keys)
        for key in keys:
            self.bets.pop(key, None)
            self.proposals_kept.pop(key, None)
            self.limits.pop(key, None)
