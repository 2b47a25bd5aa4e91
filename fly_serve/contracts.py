"""The contracts between the engine and its parts: what a round sends to a drafter and to the
scorer (the target), what comes back, and what a round reports.

Rows carry the whole token list (to a part in another process, only the tokens it does not hold
yet: row_history.py), so a drafter or target replica that has never seen the sequence (or saw an
older state) rebuilds what it needs (kv_cache.KVCache.plan). A new drafter
(a remote one, a datastore, an EAGLE head) is one class that satisfies `Drafter`.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import torch


class ParamError(ValueError):
    """A request field with a bad value; `field` is the knob's name as the engine knows it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class RowGrammar:
    """A constrained row's grammar, as a drafter needs it to draft only what it allows."""

    text: str  # llguidance's grammar text (grammar.grammar_of)
    start: int  # the sequence position its output begins at (the prompt's length)


# How a drafter of another vocabulary drafts a row (cross_vocab.py): "tli" its distribution limited
# to the tokens both vocabularies share, "string" its text re-encoded by the target's tokenizer. The
# one list: Row.cross_vocab, a request's `cross_vocab` (params.CROSS_VOCAB adds "auto") and a
# drafter's `greedy` method (config.DrafterSpec) take these.
CROSS_VOCAB_METHODS = ("tli", "string")


@dataclass(frozen=True)
class RowChat:
    """A chat request's conversation, as a drafter of another tokenizer needs it to render the
    prompt with its own chat template (cross_vocab.py)."""

    messages: tuple[tuple[str, str], ...]  # (role, content) of each message
    start: int  # the prompt's length in the target's tokens (the rendered conversation)


@dataclass
class Row:
    key: str  # the request's id: names its KV-cache slot and its random generator
    tokens: list[int]  # prompt + generated so far
    k: int = 0  # drafts wanted this round (0: plain decoding)
    mla: bool = True  # model drafter: prompt lookup proposals verified by the drafter
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    entropy: str | None = None  # the gate's entropy for this row; None: the row decides strictly
    rho: float = 0.0  # the plausibility guard of a row that decides loosely (0: none; params.rho)
    min_confidence: float = 0.0  # a model drafter stops the row once its own probability falls below
    # The model drafter's seconds per row of a batched forward over its seconds per forward (the
    # cost profile's per_row_forward / per_forward); None: unknown. It decides whether a forward
    # carries its rows' lookup proposals (drafters.lookups_pay).
    row_share: float | None = None
    # MLA: the proposal sources a model drafter tries, in order, at each of its forwards (the first
    # that proposes anything wins; params.MLA_SOURCES); a drafter without a source skips it.
    mla_sources: tuple[str, ...] = ("pld",)
    # The position of tokens[0] in the sequence: a part in another process gets only the tokens
    # it does not hold yet (row_history.py); 0: tokens is the whole sequence.
    start: int = 0
    # Draft-ahead (draft_ahead.py): before drafting, extend tokens by the drafter's own next token
    # (its argmax, no random draw) and draft k after it; Drafts.guesses gets that token. The
    # drafts are a bet on the target's verdict: a later call whose tokens drop them rewinds the
    # row's random stream to before them.
    peek: bool = False
    # The last `guessed` tokens are drafts not yet verified (a draft-ahead row carries this round's
    # drafts): a sender of row suffixes counts only the tokens before them as sent (row_history.py).
    guessed: int = 0
    # Structured output: the row's grammar (None: unconstrained). A part in another process gets
    # it with the row's whole tokens only (row_history.py keeps it with them), so it goes once.
    grammar: RowGrammar | None = None
    # A chat request's conversation (None: a raw prompt). Travels as the grammar does.
    chat: RowChat | None = None
    # A drafter of another vocabulary (cross_vocab.py): how it drafts the row, "tli" (its
    # distribution limited to the tokens both vocabularies share), "string" (its text re-encoded
    # by the target's tokenizer) or "auto" (CROSS_VOCAB_METHODS, params.CROSS_VOCAB)
    cross_vocab: str = "auto"

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


class RowTokens(Sequence):
    """A row's tokens followed by more (its drafts), without copying either: what a part feeds
    its runner, so that a round's host work does not grow with the context. `final`: how many
    leading tokens are committed for the row's key, which never change for that key (a
    request's committed tokens only grow); the torch KV cache then compares a row only past the
    part it already holds of them (kv_cache.KVCache.valid), and prompt lookup keeps an index of
    them by `key` (prompt_lookup.LookupIndexes). A slice is a list; `base` is never changed here."""

    __slots__ = ("base", "extra", "final", "key", "_nb", "_n")

    def __init__(self, base: list[int], extra: list[int] = (), final: int = 0, key: str | None = None):
        self.base, self.extra, self.key = base, extra, key
        # a view lives for one call: its base does not grow meanwhile, so the lengths are kept
        self._nb = len(base)
        self._n = self._nb + len(extra)
        self.final = max(0, min(final, self._nb))

    @classmethod
    def of(cls, row: "Row", extra: list[int] = ()) -> "RowTokens":
        """A row's tokens (its committed part final) followed by extra."""
        return cls(row.tokens, extra, len(row.tokens) - row.guessed, row.key)

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return chain(self.base, self.extra)

    def __getitem__(self, i):
        nb = self._nb
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return list(self)[i]
            if stop <= nb:
                return self.base[start:stop]
            if start >= nb:
                return list(self.extra[start - nb : stop - nb])
            return self.base[start:nb] + list(self.extra[: stop - nb])
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("RowTokens index out of range")
        return self.base[i] if i < nb else self.extra[i - nb]

    def __add__(self, more) -> "RowTokens":
        """These tokens followed by more: a view again (its committed part unchanged)."""
        return RowTokens(self.base, [*self.extra, *more], self.final, self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"RowTokens({len(self.base)} + {list(self.extra)}, final={self.final})"


@dataclass
class Drafts:
    """Per row: the drafted tokens and, for sampling rows, the distribution q [n, V] each was
    drawn from (None: a deterministic proposal, a one-hot q)."""

    tokens: list[list[int]]
    q: list[torch.Tensor | None]
    forwards: int = 0  # drafter forwards it took (batched: one forward drafts for every row)
    # per row, the drafter forwards it was in (with MLA fewer than its drafts); None: not reported
    row_forwards: list[int] | None = None
    # seconds the drafter computed, as a replica reports it (the round's call time minus this is
    # transport); None: drafted in the caller's process, so the call is the compute
    compute_s: float | None = None
    # per row, the drafter's own next token a peeking row (Row.peek) drafted after; None elsewhere
    guesses: list[int | None] | None = None
    # per row, prompt tokens this call took from the drafter's prefix cache instead of feeding
    # them (kv_cache.py); None: not reported
    prefix_hit_tokens: list[int] | None = None
    # per row, the tokens its grammar allows at the verified positions 0..m-1 (m <= drafts + 1), a
    # bitmask [m, ceil(V/32)] int32 (grammar.py); None: the row (or every row) is unconstrained.
    # The engine sets them after cutting the drafts at the first token the grammar refuses.
    masks: list[torch.Tensor | None] | None = None

    @classmethod
    def empty(cls, n_rows: int) -> "Drafts":
        return cls([[] for _ in range(n_rows)], [None] * n_rows)


@dataclass
class Verdict:
    """The target's judgement of a round's drafts, [B, K] tensors on the CPU (see verify.py).

    ok: draft i passed (greedy: equals the target's token; sampling: passed the p/q test).
    y [B, K+1]: the target's token at each position (recovered at a rejection, bonus at K).
    h: the gate's entropy at each mismatch, the only positions the gate reads (None when no row
    defers; a scorer on the host leaves the other positions 0: vocab_reads.gate_entropy).
    support: the target's processed distribution gives the draft token p > 0 (a token outside
    the nucleus is never loosely accepted).
    topk [B, K+1, n]: the ids of the target's n likeliest tokens (greedy logits, best first) at
    each position, valid up to each row's draft count; Token Recycling learns from them (None: the
    scorer does not report them).
    plausibility [B, K]: p(d_i) / max_v p(v) under the distribution the gate reads (greedy rows:
    softmax of the logits; sampling rows: the processed one), for the plausibility guard (a
    request's rho); None: the scorer does not report it (rows with rho > 0 then decide strictly)."""

    ok: torch.Tensor
    y: torch.Tensor
    h: torch.Tensor | None
    support: torch.Tensor
    topk: torch.Tensor | None = None
    plausibility: torch.Tensor | None = None
    compute_s: float | None = None  # seconds the target computed, as its replica reports it (as Drafts')
    prefix_hit_tokens: list[int] | None = None  # per row, as Drafts' (the target's prefix cache)


class DraftSource(Protocol):
    """A model-free proposer: up to k tokens continuing `tokens` ([] when it has nothing). Used
    alone (drafters.SourceDrafter) and as an MLA level inside the model drafter."""

    def propose(self, tokens: list[int], k: int) -> list[int]: ...


class Drafter(Protocol):
    def propose(self, rows: list[Row]) -> Drafts: ...

    def release(self, keys: list[str]) -> None: ...

    def share_sources(self, sources: dict[str, DraftSource]) -> None:
        """The engine's shared draft sources (its suffix index and token recycler), offered once
        at start: a drafter that proposes with MLA levels in this process takes them; one in
        another process (a remote drafter) keeps its own prompt lookup and ignores them."""

    def share_grammars(self, grammars) -> bool:
        """The engine's grammar side (grammar.Grammars: its llguidance tokenizer), offered once at
        start. Returns whether the drafter drafts constrained rows under their grammar
        (Row.grammar: greedy drafts legal, q the masked distribution); a remote one uses its
        replica's own."""


class RunnerCache(Protocol):
    """What the scorer and the drafter read of a runner's KV cache (kv_cache.KVCache, or
    llama_runner.SeqTable over llama.cpp's)."""

    capacity_tokens: int  # tokens it holds, all sequences together
    hit_tokens_total: int  # prompt tokens the prefix cache saved feeding, since start

    def valid(self, key: str, tokens: list[int]) -> int: ...

    def take_hits(self, keys: list[str]) -> list[int]: ...


class ModelRunner(Protocol):
    """A model with a KV cache per sequence, as the scorer and the model drafter drive it: the torch
    runtime (runner.Runner: GPUs, tensor parallelism, the fp32 exactness tests) or llama.cpp's
    kernels on a GGUF file (llama_runner.LlamaRunner: the CPU default)."""

    device: torch.device  # where its logits are
    vocab_size: int  # logits' width (the model's head; the parts cut it to the tokenizer's)
    cache: RunnerCache

    def feed(
        self, keys: list[str], tokens: list[list[int]], tail: list[int] | None = None, logits: bool = True, protect=()
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Bring each row's cache up to its tokens: (logits [B, T, V] of every fed position, or
        with `tail` of each row's last tail[b] tokens; the tokens fed per row)."""

    def catch_up(self, keys: list[str], tokens: list[list[int]], max_lag: int = 1) -> None:
        """Prefill the rows whose cache lags more than max_lag tokens behind."""

    def release(self, keys: list[str]) -> None: ...


class Scorer(Protocol):
    """The target side of a round: one forward over [last token, d_1..d_K] for every row."""

    vocab_size: int
    kv_capacity_tokens: int | None  # tokens its KV cache holds, all sequences together (None: unknown)

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict: ...

    def release(self, keys: list[str]) -> None: ...


@dataclass
class RoundResult:
    """What one round did, for the request stats, the serving loop and the metrics."""

    advanced: list = field(default_factory=list)  # the engine Requests of this round (failed ones too)
    drafting_rows: int = 0  # rows that had drafts
    # The round's timeline, seconds (deployments/ingress/metrics.py exports each as a phase):
    draft_s: float = 0.0  # the drafter call, as the engine waits for it
    verify_s: float = 0.0  # the target call
    decide_s: float = 0.0
    draft_compute_s: float = 0.0  # of draft_s, what the drafter computed (the rest: transport)
    verify_compute_s: float = 0.0  # of verify_s, what the target computed
    ingress_wait_s: float = 0.0  # the serving loop between rounds: its inbox, admissions (engine_loop.py)
    publish_s: float = 0.0  # the serving loop handing the round's text to its requests
    drafted: int = 0
    accepted: int = 0
    loosely_accepted: int = 0
    emitted: int = 0
    failed: list = field(default_factory=list)  # Requests this round ended with an error
    drafter_fallback: bool = False  # the model drafter failed; its rows drafted by prompt lookup
    # Draft-ahead (draft_ahead.py): rows whose drafts were made while the round before was verified
    # (hits) or had to be made again (misses), the drafts thrown away with the misses, and the
    # drafts made ahead for the next round. ahead_s: the drafter's ahead call; the waits: how long
    # each side sat idle while the other finished (verify_wait_s: the drafter waiting for the
    # verdict; draft_wait_s: the verdict waiting for the ahead drafts).
    ahead_hits: int = 0
    ahead_misses: int = 0
    ahead_dropped: int = 0
    ahead_drafted: int = 0
    ahead_s: float = 0.0
    verify_wait_s: float = 0.0
    draft_wait_s: float = 0.0
    prompt_tokens: int = 0  # prompt tokens of the rows in their first round (the prefix cache's queries)
    prefix_hit_tokens: int = 0  # tokens the target's prefix cache saved feeding, all rows
    draft_prefix_hit_tokens: int = 0  # the same on the drafter
    # per drafter (a model drafter's name, or a model-free source's kind): [drafted, kept]
    by_drafter: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.advanced)

    def merge(self, other: "RoundResult") -> None:
        """Add a sub-round (a bisected batch runs as several rounds in one step)."""
        self.advanced += other.advanced
        self.failed += other.failed
        self.drafter_fallback |= other.drafter_fallback
        for source, (drafted, kept) in other.by_drafter.items():
            counts = self.by_drafter.setdefault(source, [0, 0])
            counts[0] += drafted
            counts[1] += kept
        for name in (
            "drafting_rows",
            "draft_s",
            "verify_s",
            "decide_s",
            "draft_compute_s",
            "verify_compute_s",
            "ingress_wait_s",
            "publish_s",
            "drafted",
            "accepted",
            "loosely_accepted",
            "emitted",
            "ahead_hits",
            "ahead_misses",
            "ahead_dropped",
            "ahead_drafted",
            "ahead_s",
            "verify_wait_s",
            "draft_wait_s",
            "prompt_tokens",
            "prefix_hit_tokens",
            "draft_prefix_hit_tokens",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
