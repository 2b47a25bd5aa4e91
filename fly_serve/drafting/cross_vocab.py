"""A drafter of another model family: a draft model whose tokenizer is not the target's (Gemma's
SentencePiece vocabulary drafting for a Qwen target), behind the same Drafter protocol.

The draft model runs as it always does, a ModelDrafter (drafters.py) with its own KV cache, in
its own token space: each row's tokens are followed into the drafter's vocabulary (`Stream`), and
its drafts are turned back into the target's ids by one of two methods:

TLI (token-level intersection)  the drafter's distribution limited to the tokens both
  vocabularies share (vocab_map.py) and renormalised: its logits get -inf off the shared ids
  (ModelDrafter.limits), so every draft is a shared token and maps to one target id. At T > 0 its
  draws are keyed by the target's numbers (the target ids of its tokens and the target's
  positions: ModelDrafter.token_keys, position_shift), so a draft is the target's own keyed draw
  wherever the two distributions agree; the target keeps a draft only where it equals its own
  draw, lossless for any drafter (sampling.py). Greedy `spd` stays the target's greedy text.
  What it cannot draft: a token the drafter does not share (the target then recovers it).
string-level  (greedy rows) the drafter drafts freely in its own vocabulary; its text is
  re-encoded with the target's tokenizer, with a look-behind of the row's last few tokens so that
  the seam tokenizes as the target would (`retokenize`). The drafts are a deterministic proposal
  (q one-hot), of any length in target tokens up to the row's k; the target verifies them, FLy's
  gate and window on the target's positions as for any drafter.

Which a row uses: Row.cross_vocab ("tli", "string"; "auto": TLI for a sampling row, the
drafter's `greedy` method for a greedy one). A string-level row at T > 0 (asked for) is exact too:
its drafts are deterministic, drawn greedily.

The drafter's own stream follows what the target commits: the tokens the two share map one to one,
other text (a target token the drafter lacks, special tokens' literal text) is re-encoded with the
drafter's tokenizer (vocab_map.encode_bytes: raw bytes by its byte tokens). A stream is a list of
segments, each a run of target tokens and the drafter tokens it became (`Stream`), so when the
target rejects drafts the stream is cut back at the segment holding the first token that changed
(inside a run of shared tokens, at the token itself), and the drafter's KV cache
(content-addressed: kv_cache.py) keeps the common prefix and feeds the rest; a trailing run of
text is re-encoded with whatever follows it. Streams are kept within `max_stream_tokens` tokens in
all, the least recently followed dropped first (a row moved to another replica group never
releases this one's; a dropped stream is rebuilt from the row's tokens if the row comes back).
A chat request (Row.chat) opens with the conversation rendered by the drafter's own chat template,
where it has one; otherwise the target's rendering is followed as text, behind the drafter's BOS
where its tokenizer adds one.

MLA works in the drafter's token space: the inner drafter's prompt lookup proposes from the
drafter's stream and the drafter verifies. The engine's shared sources (suffix index, token
recycler) hold target ids and are not offered to it. Draft-ahead bets only on TLI rows (their
guess is a shared token); a string-level row makes no bet. Structured output: drafts as they
come, which the engine cuts at the first token the grammar refuses.
"""

import logging
from array import array
from collections import OrderedDict

import torch

from fly_serve.contracts import CROSS_VOCAB_METHODS, Drafts, DraftSource, Row
from fly_serve.decision.sampling import token_keys, wire_q
from fly_serve.runtime.kv_cache import common_prefix

from .drafters import ModelDrafter
from .vocab_map import SPECIAL, VocabMap, encode_bytes

log = logging.getLogger("fly_serve.drafting.cross_vocab")

METHODS = CROSS_VOCAB_METHODS  # how a drafter of another vocabulary drafts (module docstring)
LOOK_BEHIND = 4  # target tokens re-encoded with a string-level draft, so its seam tokenizes as the target would
MAX_STREAMS = 4096  # rows whose stream is kept (running ones; a lost release ages out)
# Tokens of all streams together, both sides (4 bytes each: 16 MiB at this bound): the streams of
# rows a drafter replica no longer drafts (moved to another replica group) never free their memory
# otherwise. Far above what the running rows hold (max_batch rows of max_model_len tokens).
MAX_STREAM_TOKENS = 1 << 22

# a segment's kind
RUN = 0  # shared tokens, one drafter token each: a cut inside one is offset arithmetic
TEXT = 1  # a run of text re-encoded (re-encoded again with the tokens that follow it)
FIXED = 2  # a whole that is not cut: the opening (BOS, the drafter's chat rendering), a BOS nothing stands for


class Stream:
    """One row's tokens in the drafter's vocabulary, following the target's: both sides' tokens
    and the segments that pair them, segment i holding the target tokens up to t_ends[i] and the
    drafter tokens up to d_ends[i]. Stored compactly (4 bytes a token, 9 a segment, runs of shared
    tokens merged into one segment): a stream costs about 4 bytes a token on each side."""

    __slots__ = ("target", "drafter", "t_ends", "d_ends", "kinds")

    def __init__(self, target=(), drafter=()):
        self.target, self.drafter = array("i", target), array("i", drafter)
        self.t_ends, self.d_ends, self.kinds = array("i"), array("i"), bytearray()
        self.close(FIXED)  # the opening: what the stream started with, as a whole

    def __len__(self) -> int:
        """Tokens held, both sides."""
        return len(self.target) + len(self.drafter)

    def close(self, kind: int) -> None:
        """A segment ends here (every token added since the last one is in it)."""
        self.t_ends.append(len(self.target))
        self.d_ends.append(len(self.drafter))
        self.kinds.append(kind)

    def add_shared(self, t: int, d: int) -> None:
        """A shared token, onto the run it continues."""
        self.target.append(t)
        self.drafter.append(d)
        if self.kinds[-1] == RUN:
            self.t_ends[-1] += 1
            self.d_ends[-1] += 1
        else:
            self.close(RUN)

    def cut(self, c: int, n: int) -> bool:
        """Keep what is before the first changed target token c: the segments wholly before it and
        a run up to it; a trailing run of text is dropped when tokens follow it (n: the row's
        tokens), to be re-encoded with them. False: nothing is left (open the stream anew)."""
        t_ends, d_ends, kinds = self.t_ends, self.d_ends, self.kinds
        while kinds:
            end, kind = t_ends[-1], kinds[-1]
            start = t_ends[-2] if len(kinds) > 1 else 0
            if end > c and kind == RUN and start < c:
                d_ends[-1] -= end - c  # one drafter token a target token
                t_ends[-1] = c
            elif end > c or (kind == TEXT and end < n):
                del t_ends[-1], d_ends[-1], kinds[-1]
                continue
            break
        if not kinds:
            return False
        del self.target[t_ends[-1] :], self.drafter[d_ends[-1] :]
        return True


def _adds_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts in front of an encoding, else None."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else None


class CrossVocabDrafter:
    def __init__(
        self,
        inner: ModelDrafter,
        vmap: VocabMap,
        target_tokenizer,
        drafter_tokenizer,
        greedy: str = "string",
        vocab_size: int | None = None,
        max_stream_tokens: int = MAX_STREAM_TOKENS,
    ):
        """inner: the draft model as a ModelDrafter in its own vocabulary; vmap: the pair's map;
        greedy: the method of a greedy row whose request says "auto"; vocab_size: the target's
        width of q (its tokenizer's tokens); max_stream_tokens: the streams' bound (module
        docstring)."""
        if greedy not in METHODS:
            raise ValueError(f"greedy: must be one of {', '.join(METHODS)} (got {greedy!r})")
        self.inner, self.vmap, self.greedy = inner, vmap, greedy
        self.target_tokenizer, self.drafter_tokenizer = target_tokenizer, drafter_tokenizer
        self.runner = inner.runner  # the engine's per-stage thread settings reach the model (draft-ahead)
        self.kv_capacity_tokens = inner.kv_capacity_tokens  # in the drafter's tokens
        self.vocab_size = vocab_size or len(target_tokenizer)
        self.streams: OrderedDict[str, Stream] = OrderedDict()
        self.max_stream_tokens, self.stream_tokens = max_stream_tokens, 0  # the bound, and all streams' len
        self.target_bos, self.drafter_bos = _adds_bos(target_tokenizer), _adds_bos(drafter_tokenizer)
        self.has_template = bool(getattr(drafter_tokenizer, "chat_template", None))
        self.drafted = {m: 0 for m in METHODS}  # target drafts made by each method since start
        # TLI at T > 0: the drafter's keyed draws use the target's numbers (its tokens' target ids,
        # the target's positions: ModelDrafter.token_keys), so a draft is the target's own draw
        # wherever the two distributions agree; an unshared token is masked, its key unused.
        ids = torch.zeros(inner.vocab_size, dtype=torch.long)
        shared = torch.as_tensor(vmap.to_target[: inner.vocab_size], dtype=torch.long)
        ids[: len(shared)] = shared.clamp(min=0)
        inner.token_keys = token_keys(ids).to(inner.runner.device)

    # ---- what the engine and the replicas read of a model drafter
    @property
    def forwards(self) -> int:
        return self.inner.forwards

    @property
    def hits(self) -> int:
        return self.inner.hits

    @property
    def misses(self) -> int:
        return self.inner.misses

    def cache_report(self) -> dict:
        return self.inner.cache_report() | {
            "shared_tokens": self.vmap.n_shared,
            "drafted_by_method": dict(self.drafted),
            "streams": len(self.streams),
            "stream_tokens": self.stream_tokens,
        }

    def share_sources(self, sources: dict[str, DraftSource]) -> None:
        pass  # the engine's sources hold target ids; MLA here is the inner drafter's own prompt lookup

    def share_grammars(self, grammars) -> bool:
        return False  # grammars speak the target's ids: the engine cuts the drafts at a refused token

    def method(self, row: Row) -> str:
        if row.cross_vocab in METHODS:
            return row.cross_vocab
        return "tli" if row.sampled else self.greedy

    # ---- a round's drafts
    def propose(self, rows: list[Row]) -> Drafts:
        out = Drafts.empty(len(rows))
        idx, inner_rows, methods = [], [], []
        mask = self.vmap.drafter_mask(self.inner.vocab_size, self.inner.runner.device)
        for b, r in enumerate(rows):
            method = self.method(r)
            if r.k <= 0 or (r.peek and method != "tli"):  # a string-level row makes no bet
                continue
            stream = self.follow(r)
            if method == "tli":
                self.inner.limits[r.key] = mask
                self.inner.position_shift[r.key] = r.start + len(r.tokens) - len(stream)
            else:
                self.inner.limits.pop(r.key, None)
                self.inner.position_shift.pop(r.key, None)
            sampled = method == "tli" and r.sampled  # a string-level row drafts greedily (deterministic)
            idx.append(b)
            methods.append(method)
            inner_rows.append(
                Row(
                    r.key,
                    stream,
                    r.k,
                    r.mla,
                    r.temperature if sampled else 0.0,
                    r.top_p,
                    r.seed,
                    min_confidence=r.min_confidence,
                    row_share=r.row_share,
                    mla_sources=r.mla_sources,
                    peek=r.peek,
                    # no stream token counts as committed (RowTokens.final 0): a stream's tail is
                    # re-encoded when the target's text changes, and a lost bet's drafts are in
                    # it, so the drafter's KV cache compares the whole stream every call
                    guessed=len(stream),
                )
            )
        if not inner_rows:
            return out
        got = self.inner.propose(inner_rows)
        out.forwards, out.row_forwards = got.forwards, [0] * len(rows)
        out.prefix_hit_tokens = [0] * len(rows)
        if any(r.peek for r in inner_rows):
            out.guesses = [None] * len(rows)
        for i, (b, method) in enumerate(zip(idx, methods)):
            r = rows[b]
            if method == "tli":
                out.tokens[b], out.q[b] = self._from_tli(got.tokens[i], got.q[i])
                if out.guesses is not None and got.guesses is not None and got.guesses[i] is not None:
                    g = int(self.vmap.to_target[got.guesses[i]])
                    out.guesses[b] = g if g >= 0 else None
            else:
                out.tokens[b] = self.retokenize(r.tokens, got.tokens[i])[: r.k]
            self.drafted[method] += len(out.tokens[b])
            if got.row_forwards is not None:
                out.row_forwards[b] = got.row_forwards[i]
            if got.prefix_hit_tokens is not None:
                out.prefix_hit_tokens[b] = got.prefix_hit_tokens[i]
        return out

    def _from_tli(self, drafted: list[int], q: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """TLI drafts (shared drafter ids) as target ids, q [n, V_drafter] as [n, V_target]."""
        ids = [int(self.vmap.to_target[d]) for d in drafted]
        n = next((j for j, t in enumerate(ids) if t < 0), len(ids))  # never past a shared id (the mask)
        if q is None:
            return ids[:n], None
        return ids[:n], wire_q(self.vmap.q_to_target(q, self.vocab_size)[:n])

    def retokenize(self, tokens: list[int], drafted: list[int]) -> list[int]:
        """String-level: the drafter's drafts (its ids) as the target's tokens continuing `tokens`.
        The draft text is re-encoded behind the row's last LOOK_BEHIND tokens of text; where that
        re-encoding keeps them as they are, the tokens after them are the drafts, else the seam
        merges text the target already committed otherwise and the text is encoded alone. A
        drafted EOS ends the drafts with the target's."""
        dv, tv = self.vmap.drafter, self.vmap.target
        ids, end = [], False
        for d in drafted:
            if dv.kinds[d] == SPECIAL:
                end = d == dv.eos
                break
            ids.append(d)
        text = dv.text_of(ids)
        out: list[int] = []
        if text:
            n = 0
            while n < min(LOOK_BEHIND, len(tokens)) and tv.kinds[tokens[-1 - n]] != SPECIAL:
                n += 1
            tail = tokens[len(tokens) - n :]
            enc = encode_bytes(self.target_tokenizer, tv, tv.text_of(tail) + text)
            out = enc[n:] if enc[:n] == tail else encode_bytes(self.target_tokenizer, tv, text)
        if end and tv.eos is not None:
            out.append(tv.eos)
        return out

    # ---- the drafter's stream
    def follow(self, row: Row) -> list[int]:
        """The row's tokens in the drafter's vocabulary (module docstring), its stream updated."""
        tokens = row.tokens
        s = self.streams.pop(row.key, None)
        if s is not None:
            self.stream_tokens -= len(s)
            if not s.cut(common_prefix(s.target, array("i", tokens)), len(tokens)):
                s = None
        if s is None:
            s = self._open(row)
        self._extend(s, tokens[s.t_ends[-1] :])
        self._keep(row.key, s)
        return s.drafter.tolist()

    def _keep(self, key: str, s: Stream) -> None:
        """The stream kept as the most recently followed; the least recent ones dropped while the
        streams hold more than max_stream_tokens in all (or are more than MAX_STREAMS)."""
        self.streams[key] = s
        self.stream_tokens += len(s)
        while len(self.streams) > 1 and (
            self.stream_tokens > self.max_stream_tokens or len(self.streams) > MAX_STREAMS
        ):
            _, old = self.streams.popitem(last=False)
            self.stream_tokens -= len(old)

    def _open(self, row: Row) -> Stream:
        """A new stream: the conversation in the drafter's own chat template (Row.chat), or the
        drafter's BOS (where its tokenizer adds one and the target's does not: the target's BOS
        maps to it), as its first segment."""
        chat = row.chat
        if chat is not None and self.has_template and len(row.tokens) >= chat.start:
            try:
                text = self.drafter_tokenizer.apply_chat_template(
                    [{"role": role, "content": content} for role, content in chat.messages],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                ids = self.drafter_tokenizer.encode(text, add_special_tokens=False)
                return Stream(row.tokens[: chat.start], ids)
            except Exception:  # a template that refuses the conversation: the target's rendering as text
                log.warning("the drafter's chat template refused a conversation; following the target's", exc_info=True)
        opening = [self.drafter_bos] if self.drafter_bos is not None and self.target_bos is None else []
        return Stream((), opening)

    def _extend(self, s: Stream, new: list[int]) -> None:
        """Append target tokens to the stream: a shared token as its drafter token, the target's
        BOS as the drafter's, every other run as its text re-encoded."""
        run: list[int] = []
        to_drafter = self.vmap.to_drafter

        def flush():
            if run:
                ids = encode_bytes(self.drafter_tokenizer, self.vmap.drafter, self.vmap.target.text_of(run))
                s.target.extend(run)
                s.drafter.extend(ids)
                s.close(TEXT)
                run.clear()

        for t in new:
            d = int(to_drafter[t]) if 0 <= t < len(to_drafter) else -1
            if t == self.target_bos:
                d = self.drafter_bos if self.drafter_bos is not None else -2  # -2: nothing stands for it
            if d == -1:
                run.append(t)
                continue
            flush()
            if d >= 0:
                s.add_shared(t, d)
            else:
                s.target.append(t)
                s.close(FIXED)
        flush()

    def release(self, keys: list[str]) -> None:
        self.inner.release(keys)
        for key in keys:
            s = self.streams.pop(key, None)
            if s is not None:
                self.stream_tokens -= len(s)
