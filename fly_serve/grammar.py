"""Structured output: a request's `response_format` (JSON object or JSON schema), `regex` or Lark
`grammar`, compiled by llguidance, and one matcher per request that the engine steps along the
committed tokens and tries each round's drafts against.

The engine owns the matchers (they follow the committed tokens, so a retried or bisected round
and a replaced replica never desynchronize them) and sends the scorer only the allowed-token
bitmask of each verified position ([n+1, ceil(V/32)] int32 a row, 19 KB a position for 152k
tokens): the target, wherever it runs, needs no grammar library, no tokenizer and no state.

Why llguidance rather than xgrammar: both compiled every schema measured (nested objects, arrays,
enums, anyOf/oneOf, pattern, $ref); llguidance compiles a schema in 1-2 ms against xgrammar's 2-64
ms (a schema per request: this is time to first token), and its mask, 0.07-0.5 ms a position, is
well under 1% of a target forward here; it is one small wheel with no torch dependency, where
xgrammar pulls triton (docs/BENCHMARKS.md, "Structured output").
"""

import json
import logging
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch

from .params import ParamError

log = logging.getLogger("fly_serve.grammar")

# One line of JSON, separators as json.dumps writes them: no free whitespace, so a model (or a
# random tiny one) cannot spend max_tokens on blanks, and every output parses as it stands.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _schema_of(response_format) -> dict | bool | None:
    """The JSON schema an OpenAI `response_format` asks for (None: plain text)."""
    if not isinstance(response_format, dict):
        raise ParamError("response_format", "must be an object with a `type`")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ParamError("response_format", f"type must be one of {', '.join(RESPONSE_FORMATS)} (got {kind!r})")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ParamError("response_format", "json_schema: must be an object with a `schema`")
    if "name" in spec and not isinstance(spec["name"], str):
        raise ParamError("response_format", "json_schema.name: must be a string")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise ParamError("response_format", "json_schema.schema: must be a JSON schema (an object)")
    return schema


def grammar_of(response_format=None, regex: str | None = None, grammar: str | None = None) -> tuple[str, str] | None:
    """(the field that asked, llguidance's grammar text) of a request, None when unconstrained.
    Raises ParamError naming the field when it is malformed or the library refuses it."""
    asked = [(n, v) for n, v in (("response_format", response_format), ("regex", regex), ("grammar", grammar))]
    asked = [(n, v) for n, v in asked if v is not None]
    if len(asked) > 1:
        raise ParamError(asked[1][0], f"only one of response_format, regex, grammar may be set (got {asked[0][0]})")
    if not asked:
        return None
    name, value = asked[0]
    if name == "response_format":
        schema = _schema_of(value)
        if schema is None:
            return None
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ParamError(name, f"not a JSON schema: {e}") from None
    elif not isinstance(value, str) or not value:
        raise ParamError(name, "must be a non-empty string")
    elif name == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(value)
    else:
        text = llguidance.LLMatcher.grammar_from_lark(value)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise ParamError(name, f"refused by the grammar library: {error}")
    return name, text


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [..., W] int32 (bit j of word w: token 32w + j allowed) -> allowed [..., V] bool."""
    bits = (bitmask[..., None] >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_masks(logits: torch.Tensor, masks: list[torch.Tensor | None] | None) -> None:
    """In place: -inf at every token a row's grammar refuses, at the positions its bitmask covers
    (logits [B, K+1, V]; masks per row [m, W] for positions 0..m-1, None: unconstrained). Every
    later read (argmax, sampling, entropy, support) then sees the masked distribution."""
    with torch.inference_mode():  # the runner's logits are inference tensors
        for b, mask in enumerate(masks or []):
            if mask is None:
                continue
            allowed = unpack(mask.to(logits.device), logits.shape[-1])  # [m, V]
            logits[b, : mask.shape[0]].masked_fill_(~allowed, float("-inf"))


class Matcher:
    """A request's grammar state after its committed tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, eos_ids: set[int]):
        self.m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.m.is_error():
            raise ParamError("grammar", self.m.get_error())
        self.text, self.eos_ids = grammar, eos_ids
        self.pushed = 0  # tokens consumed tentatively (push), undone by pop

    def accept(self, tokens: list[int]) -> None:
        """Commit tokens (already allowed by the masks); EOS ends the sequence, it is not fed."""
        tokens = [t for t in tokens if t not in self.eos_ids]
        if tokens and not self.m.consume_tokens(tokens):
            raise RuntimeError(f"grammar refused a committed token: {self.m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but EOS."""
        return self.m.is_stopped()

    def mask(self) -> torch.Tensor:
        """The allowed tokens at the next position, a bitmask [W] int32."""
        return torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)

    def plan(self, drafts: list[int]) -> tuple[int, torch.Tensor]:
        """(how many leading drafts the grammar allows, the masks [m, W] of positions 0..m-1 along
        them): m = legal + 1, the position after the last legal draft included. An EOS draft is
        the last one looked at. The matcher ends where it began (rolled back)."""
        masks, legal = [], 0
        for t in drafts:
            mask = self.mask()
            masks.append(mask)
            if not (int(mask[t >> 5]) >> (t & 31)) & 1:
                break
            legal += 1
            if t in self.eos_ids:
                break
            self.m.consume_token(t)
        else:
            masks.append(self.mask())
        self.m.rollback(legal - (1 if legal and drafts[legal - 1] in self.eos_ids else 0))
        return legal, torch.stack(masks)

    def until_eos(self, tokens: list[int]) -> int:
        """How many leading tokens come before the first EOS (all of them without one)."""
        return next((i for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (keys, quotes, braces of a schema), [] when it
        leaves a choice."""
        return list(self.m.compute_ff_tokens())

    def push(self, tokens: list[int]) -> int:
        """Consume tokens tentatively (a drafter's drafts), up to the first one the grammar refuses
        or an EOS (never fed); returns how many it consumed. `pop` undoes every push."""
        end = self.until_eos(tokens)
        n = self.m.validate_tokens(tokens[:end]) if end else 0
        if n and not self.m.consume_tokens(tokens[:n]):
            raise RuntimeError(f"grammar refused a validated token: {self.m.get_error()}")
        self.pushed += n
        return n

    def pop(self) -> None:
        self.m.rollback(self.pushed)
        self.pushed = 0


class Grammars:
    """The engine's grammar side: the tokenizer as llguidance reads it (built on first use: about
    2 s for a 152k vocabulary) and a Matcher per constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, set(eos_ids)
        self._tokenizer = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            eos = sorted(self.eos_ids) or None
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def warm(self) -> None:
        """Build the tokenizer now; a tokenizer llguidance cannot read (not a fast one) leaves
        structured output refused per request (matcher) rather than the engine unbuilt."""
        try:
            _ = self.tokenizer
        except Exception:
            log.warning("structured output unavailable: llguidance cannot read this tokenizer", exc_info=True)

    def matcher(self, params) -> Matcher | None:
        """The request's matcher, None when unconstrained; ParamError names the field at fault."""
        asked = grammar_of(params.response_format, params.regex, params.grammar)
        if asked is None:
            return None
        name, text = asked
        try:
            tokenizer = self.tokenizer
        except Exception as e:
            raise ParamError(name, f"structured output is not available with this tokenizer ({e})") from None
        try:
            return Matcher(tokenizer, text, self.eos_ids)
        except ParamError as e:
            raise ParamError(name, f"refused by the grammar library: {e.message}") from None
        except ValueError as e:  # llguidance raises on a grammar it cannot build for this tokenizer
            raise ParamError(name, f"refused by the grammar library: {e}") from None


class DraftMatchers:
    """A drafter's side of structured output: a Matcher per constrained row (Row.grammar), kept
    at the row's committed tokens (all but its guessed tail, Row.guessed) and built on the row's
    first call here. The engine's matcher stays the authoritative one (it cuts every draft it is
    given); this one only steers the drafter, so a row it cannot follow drafts unmasked."""

    def __init__(self, grammars: Grammars, max_rows: int = 1024):
        self.grammars, self.max_rows = grammars, max_rows
        self.by_key: OrderedDict[str, tuple[Matcher, int]] = OrderedDict()  # key -> (matcher, tokens fed up to)

    def at(self, row) -> Matcher | None:
        """The row's matcher after its committed tokens, its guessed tail pushed (pop undoes it);
        None: unconstrained, or a tail the grammar refuses (a sampled refused draft: that bet
        cannot win), or a grammar this side cannot follow."""
        if row.grammar is None:
            return None
        committed = len(row.tokens) - row.guessed
        held = self.by_key.pop(row.key, None)
        try:
            if held is None or held[0].text != row.grammar.text or held[1] > committed:
                held = (Matcher(self.grammars.tokenizer, row.grammar.text, self.grammars.eos_ids), row.grammar.start)
            m = held[0]
            m.accept(row.tokens[held[1] : committed])
        except Exception:  # a part that cannot follow the row drafts it unmasked; the engine cuts
            log.warning("drafter: row %s's grammar not followed; drafting it unmasked", row.key, exc_info=True)
            return None
        self.by_key[row.key] = (m, committed)
        while len(self.by_key) > self.max_rows:  # a lost release costs a rebuild, never memory without end
            self.by_key.popitem(last=False)
        tail = row.tokens[committed:]
        if m.push(tail) < len(tail):
            m.pop()
            return None
        return m

    def release(self, keys: list[str]) -> None:
        for key in keys:
            self.by_key.pop(key, None)
