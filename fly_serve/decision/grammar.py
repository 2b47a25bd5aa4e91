"""Structured output: a request's `response_format` (JSON object or JSON schema), `regex` or Lark
`grammar`, compiled by llguidance, and one matcher per request that the engine steps along the
committed tokens and tries each round's drafts against.

The engine owns the matchers (they follow the committed tokens, so a retried or bisected round
and a replaced replica never desynchronize them) and sends the scorer only the allowed-token
bitmask of each verified position ([n+1, ceil(V/32)] int32 a row, 19 KB a position for 152k
tokens): the target, wherever it runs, needs no grammar library, no tokenizer and no state.

Why llguidance rather than xgrammar: both compiled every schema tried; llguidance compiled faster
(a schema per request: this is time to first token), its mask costs a small share of a target
forward, and it is one small wheel with no torch dependency, where xgrammar pulls triton
(measured: docs/journal.md, "Structured output").

llguidance builds its lexer lazily, so a grammar it accepts may still fail on the first tokens
(a regex of a million repetitions: "too many expressions constructed"), and a grammar that no
text completes (`start: x`, `x: x`; a schema whose $refs only loop) is found only at its first
mask. `Grammars.check` therefore compiles a request's grammar and walks a few tokens along it
before the request is admitted, so that these are the request's 400; the matcher it compiled is
handed to the engine thread with the request (`Grammars.handing`), which never compiles a served
request's grammar again (a large schema costs a second or more). A dead end found later (a
grammar whose only way leads, after many tokens, to a rule nothing completes) is still the
request's own input: the matcher records it (`Matcher.failed`, with the field that asked for it)
and its request fails alone as the client's error (never a 200 with what came before). Drafts are
tried on a copy of the matcher (`plan`), since the library's error state outlives a rollback: a
draft that leads into a dead end is refused, and the committed state stays sound.
"""

import json
import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager

import llguidance
import llguidance.hf
import torch

from fly_serve.contracts import ParamError

log = logging.getLogger("fly_serve.decision.grammar")

# One line of JSON, separators as json.dumps writes them: no free whitespace, so a model (or a
# random tiny one) cannot spend max_tokens on blanks, and every output parses as it stands.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# The library's own limits, but errors without its parser state and the grammar in them: their
# first line goes to the client, and the grammar is the client's own data.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Tokens a grammar is walked along before its request is admitted (Grammars.check): the lazily
# built lexer meets a grammar it cannot follow on the first of them, for a few milliseconds.
PROBE_TOKENS = 8
# The library reads a grammar as JSON nested at most 128 levels deep (serde_json's limit; its
# wrapper takes 3); a schema nesting deeper has its subschemas below this depth moved to $defs.
LIBRARY_DEPTH = 124
MOVE_BELOW = 32
# Compiled grammars kept (by their llguidance text) for the drafter's matchers in this process:
# a copy of one costs microseconds where compiling a large schema costs a second.
COMPILED_KEPT = 32


class GrammarFailed(RuntimeError):
    """The grammar library gave up on a request's grammar midway (a limit, a dead end): that
    request cannot go on; the others are not affected."""


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


def _why(error: str) -> str:
    """The library's error as the client reads it: a grammar that nothing completes said so."""
    line = _first_line(error)
    if line.startswith("NoExtension"):
        return "no text matches it (it can never be completed)"
    return f"refused by the grammar library: {line}"


def json_depth(value) -> int:
    """How deep JSON containers nest in value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in children)
    return deepest


# Where a JSON schema holds subschemas: one, a map of them, a list of them (draft 2020-12's
# keywords, and draft 4-7's "definitions", "dependencies" and "items"/"additionalItems" forms)
ONE_SCHEMA = (
    "additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _subschemas(node: dict):
    """(container, key, path within node) of every subschema position directly in a schema node."""
    for word in ONE_SCHEMA:
        if isinstance(node.get(word), dict):
            yield node, word, (word,)
    for word in SCHEMA_MAPS:
        if isinstance(node.get(word), dict):
            for name, sub in node[word].items():
                if isinstance(sub, dict):
                    yield node[word], name, (word, name)
    for word in SCHEMA_LISTS:
        if isinstance(node.get(word), list):
            for i, sub in enumerate(node[word]):
                if isinstance(sub, dict):
                    yield node[word], i, (word, str(i))


def _pointer(path: tuple) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


def shallow_schema(schema):
    """The same schema nesting at most LIBRARY_DEPTH levels where it can: every subschema more
    than MOVE_BELOW levels below the one it hangs from is moved to the root's $defs and referred
    to from where it was, and every $ref into a moved part is pointed at its new place. What a
    schema nests that is no subschema (an enum's values) stays, and is refused if still too deep."""
    if not isinstance(schema, dict) or json_depth(schema) <= LIBRARY_DEPTH:
        return schema
    root = json.loads(json.dumps(schema))  # a copy to rewrite (C code: no Python recursion)
    defs = root.setdefault("$defs", {})
    moved: dict[str, str] = {}  # the pointer a moved subschema had -> its pointer now
    stack = [(root, (), 0)]  # (schema node, its original path, its depth below its segment's top)
    while stack:
        node, path, depth = stack.pop()
        for container, key, rel in _subschemas(node):
            sub, sub_path = container[key], path + rel
            sub_depth = depth + len(rel)
            if sub_depth > MOVE_BELOW:
                name = f"fly_moved_{len(moved)}"
                while name in defs:
                    name += "_"
                defs[name], container[key] = sub, {"$ref": f"#/$defs/{name}"}
                moved[_pointer(sub_path)] = f"#/$defs/{name}"
                sub_depth = 0
            stack.append((sub, sub_path, sub_depth))
    _repoint(root, moved)
    return root


def _repoint(root: dict, moved: dict[str, str]) -> None:
    """Every "$ref" into a moved subschema, pointed at its new place (the longest moved prefix:
    the innermost move)."""
    stack = [root]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                hits = [old for old in moved if ref == old or ref.startswith(old + "/")]
                if hits:
                    old = max(hits, key=len)
                    v["$ref"] = moved[old] + ref[len(old) :]
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _schema_of(response_format) -> dict | bool | None:
    """The JSON schema an OpenAI `response_format` asks for (None: plain text). A json_schema
    format must carry its schema, as it must carry its json_schema object: for any JSON,
    {"type": "json_object"} says so."""
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
    if "schema" not in spec:
        raise ParamError("response_format", 'json_schema.schema: required (for any JSON: {"type": "json_object"})')
    schema = spec["schema"]
    if not isinstance(schema, dict | bool):
        raise ParamError("response_format", "json_schema.schema: must be a JSON schema (an object)")
    return schema


def _schema_grammar(schema) -> str:
    """llguidance's grammar of a JSON schema (shallow_schema first: the library reads 128 levels)."""
    try:
        schema = shallow_schema(schema)
    except RecursionError:  # past Python's own limit (the body parser refuses such JSON first)
        raise ParamError("response_format", "json_schema.schema: nested too deeply") from None
    if json_depth(schema) > LIBRARY_DEPTH:
        raise ParamError(
            "response_format", f"json_schema.schema: nests data deeper than {LIBRARY_DEPTH} levels (enum, const)"
        )
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ParamError("response_format", f"not a JSON schema: {e}") from None


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
        text = _schema_grammar(schema)
    elif not isinstance(value, str) or not value:
        raise ParamError(name, "must be a non-empty string")
    elif not _is_text(value):
        raise ParamError(name, "not valid Unicode text (a lone surrogate)")
    elif name == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(value)
    else:
        text = llguidance.LLMatcher.grammar_from_lark(value)
    error = llguidance.LLMatcher.validate_grammar(text, limits=LIMITS)
    if error and not error.startswith("WARNING"):
        raise ParamError(name, f"refused by the grammar library: {_first_line(error)}")
    return name, text


def _is_text(value: str) -> bool:
    """value encodes as UTF-8 (JSON's "\\ud800" decodes to a lone surrogate, which the library
    cannot take)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [..., W] int32 (bit j of word w: token 32w + j allowed) -> allowed [..., V] bool."""
    bits = (bitmask[..., None] >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_masks(logits: torch.Tensor, masks: list[torch.Tensor | None] | None) -> None:
    """In place: -inf at every token a row's grammar refuses, at the positions its bitmask covers
    (logits [B, K+1, V]; masks per row [m, W] for positions 0..m-1, None: unconstrained). Every
    later read (argmax, sampling, entropy, support) then sees the masked distribution."""
    if masks is None:
        return
    with torch.inference_mode():  # the runner's logits are inference tensors
        for b, mask in enumerate(masks or []):
            if mask is None:
                continue
            allowed = unpack(mask.to(logits.device), logits.shape[-1])  # [m, V]
            logits[b, : mask.shape[0]].masked_fill_(~allowed, float("-inf"))


class Matcher:
    """A request's grammar state after its committed tokens. Once the grammar has no way on from
    them (a dead end the probe did not reach, or a limit of the library), `failed` says why: the
    masks then allow EOS alone, and committing raises GrammarFailed, so its request ends with an
    error, blamed on `field` (the request's response_format, regex or grammar)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, eos_ids: set[int], field: str = "grammar"):
        self.m = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if self.m.is_error():
            raise ParamError(field, _first_line(self.m.get_error()))
        self.text, self.eos_ids, self.field = grammar, eos_ids, field
        self.pushed = 0  # tokens consumed tentatively (push), undone by pop
        self.failed: str | None = None
        self.spec: tuple | None = None  # the request's (response_format, regex, grammar) it was compiled for

    def copy(self) -> "Matcher":
        """A matcher of the same grammar in the same state (no compiling: the library copies it)."""
        out = object.__new__(Matcher)
        out.m, out.text, out.eos_ids, out.field = self.m.deep_copy(), self.text, self.eos_ids, self.field
        out.pushed, out.failed, out.spec = 0, self.failed, self.spec
        return out

    def _fail(self, why: str) -> GrammarFailed:
        self.failed = self.failed or why
        return GrammarFailed(self.failed)

    def accept(self, tokens: list[int]) -> None:
        """Commit tokens (already allowed by the masks); EOS ends the sequence, it is not fed."""
        if self.failed:  # the masks allowed EOS alone: an end the grammar never reached
            raise GrammarFailed(self.failed)
        tokens = [t for t in tokens if t not in self.eos_ids]
        if tokens and not self.m.consume_tokens(tokens):
            raise self._fail(f"grammar refused a committed token: {_why(self.m.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but EOS."""
        return self.m.is_stopped()

    def mask(self) -> torch.Tensor:
        """The allowed tokens at the next position, a bitmask [W] int32 (EOS alone once failed)."""
        return self._mask_of(self.m, self)

    @staticmethod
    def _mask_of(m: llguidance.LLMatcher, owner: "Matcher | None") -> torch.Tensor:
        """m's mask; a failed one (EOS alone) marks `owner` failed, with the library's reason."""
        bits = m.compute_bitmask()
        if m.is_error() and owner is not None:
            owner._fail(f"the grammar has no way on from here: {_why(m.get_error())}")
        return torch.frombuffer(bytearray(bits), dtype=torch.int32)

    def allows(self, mask: torch.Tensor, token: int) -> bool:
        return bool((int(mask[token >> 5]) >> (token & 31)) & 1)

    def plan(self, drafts: list[int]) -> tuple[int, torch.Tensor]:
        """(how many leading drafts the grammar allows, the masks [m, W] of positions 0..m-1 along
        them): m = legal + 1, the position after the last legal draft included. An EOS draft is
        the last one looked at. The drafts are walked on a copy (the matcher stays where it is):
        a draft after which the grammar has no way on is refused too, and its bit cleared from
        its position's mask where that leaves a choice; a mask that fails at the matcher's own
        position marks it failed (mask)."""
        walker, masks, legal = self.m.deep_copy(), [], 0
        for t in [*drafts, None]:
            mask = self._mask_of(walker, self if legal == 0 else None)
            if walker.is_error() and legal > 0:  # drafts[legal - 1] leads nowhere
                legal -= 1
                narrowed = masks[-1].clone()
                narrowed[drafts[legal] >> 5] &= ~(1 << (drafts[legal] & 31))
                if narrowed.any():
                    masks[-1] = narrowed
                break
            masks.append(mask)
            if t is None or walker.is_error() or not self.allows(mask, t):
                break
            legal += 1
            if t in self.eos_ids:
                break
            walker.consume_token(t)
        return legal, torch.stack(masks)

    def probe(self, steps: int) -> None:
        """Walk up to `steps` tokens along the grammar (each the lowest id it allows but EOS), on
        a copy: the lexer and parser build what the first tokens need, and a grammar the library
        cannot follow, or that nothing completes, raises GrammarFailed here."""
        walker = self.m.deep_copy()
        for _ in range(steps):
            bits = walker.compute_bitmask()
            if walker.is_error():
                raise GrammarFailed(_why(walker.get_error()))
            allowed = torch.nonzero(unpack(torch.frombuffer(bytearray(bits), dtype=torch.int32), 1 << 31))
            token = next((t for t in allowed.flatten().tolist() if t not in self.eos_ids), None)
            if token is None or walker.is_stopped():  # complete: nothing but EOS may follow
                return
            if not walker.consume_token(token) or walker.is_error():
                raise GrammarFailed(_why(walker.get_error()))

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
            raise self._fail(f"grammar refused a validated token: {_why(self.m.get_error())}")
        self.pushed += n
        return n

    def pop(self) -> None:
        self.m.rollback(self.pushed)
        self.pushed = 0


class Grammars:
    """The engine's grammar side: the tokenizer as llguidance reads it (built on first use: about
    2 s for a 152k vocabulary), a Matcher per constrained request, and the grammars compiled in
    this process (by their text, COMPILED_KEPT at most) for the drafter's matchers to copy."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, set(eos_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[str, Matcher] = OrderedDict()  # text -> a matcher at its start
        self._lock = threading.Lock()  # check() runs in worker threads
        self._handed = threading.local()  # .item: (spec, matcher), the next admission's on that thread

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

    @staticmethod
    def _spec(params) -> tuple:
        return (params.response_format, params.regex, params.grammar)

    @contextmanager
    def handing(self, matcher: Matcher | None):
        """Within this block, on this thread, the next matcher(params) of the grammar `matcher`
        was compiled for is `matcher` (compiled and probed by `check` in a worker thread), not a
        new compilation: the engine loop admits the request inside it, on the engine thread."""
        self._handed.item = matcher
        try:
            yield
        finally:
            self._handed.item = None

    def matcher(self, params, probe_tokens: int = 0) -> Matcher | None:
        """The request's matcher, None when unconstrained; ParamError names the field at fault.
        Its first mask is computed here: a grammar that nothing completes is refused now.
        probe_tokens: walk that many tokens along it too (Matcher.probe). The one handed over
        for this grammar (handing) is taken as it is."""
        handed, self._handed.item = getattr(self._handed, "item", None), None
        if handed is not None and handed.spec == self._spec(params):
            return handed
        return self._compile(params, probe_tokens)

    def _compile(self, params, probe_tokens: int) -> Matcher | None:
        asked = grammar_of(params.response_format, params.regex, params.grammar)
        if asked is None:
            return None
        name, text = asked
        try:
            tokenizer = self.tokenizer
        except Exception as e:
            raise ParamError(name, f"structured output is not available with this tokenizer ({e})") from None
        try:
            m = Matcher(tokenizer, text, self.eos_ids, field=name)
            m.probe(max(probe_tokens, 1))
        except ParamError as e:
            raise ParamError(name, f"refused by the grammar library: {e.message}") from None
        except GrammarFailed as e:
            raise ParamError(name, str(e)) from None
        except ValueError as e:  # llguidance raises on a grammar it cannot build for this tokenizer
            raise ParamError(name, f"refused by the grammar library: {e}") from None
        m.spec = self._spec(params)
        self._keep(m)
        return m

    def check(self, params) -> Matcher | None:
        """What admission would refuse of the request's grammar, and what the library cannot
        follow along its first PROBE_TOKENS tokens: ParamError naming the field (the ingress
        calls this in a worker thread, before the request reaches the engine thread). Returns
        the compiled matcher, to hand to the engine thread (handing)."""
        return self._compile(params, PROBE_TOKENS)

    def _keep(self, m: Matcher) -> None:
        with self._lock:
            self._compiled[m.text] = m.copy()
            self._compiled.move_to_end(m.text)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)

    def fresh(self, text: str, field: str = "grammar") -> Matcher:
        """A matcher of this grammar text at its start: a copy of one compiled here, else compiled."""
        with self._lock:  # copied under the lock: one matcher is never read by two threads at once
            kept = self._compiled.get(text)
            if kept is not None:
                return kept.copy()
        m = Matcher(self.tokenizer, text, self.eos_ids, field=field)
        self._keep(m)
        return m


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
            stale = held is None or held[0].text != row.grammar.text or held[1] > committed or held[0].failed
            if stale:  # a failed one (a draft into a dead end) is rebuilt: the engine's stays sound
                held = (self.grammars.fresh(row.grammar.text), row.grammar.start)
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
