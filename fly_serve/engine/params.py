"""Per-request knobs, the one list of them, and the table of modes.

`Params` is the only place a knob is declared: the HTTP API's option models and the command
line's flags are derived from its fields (their `metadata`), so a knob added here appears in
both. A bad value is a `ParamError` that names the field.
"""

from dataclasses import dataclass, field, fields

from fly_serve.contracts import CROSS_VOCAB_METHODS, ParamError

ENTROPIES = ("topk", "full")  # top-3 entropy in nats (authors' code, vLLM port); normalized full-vocab (paper)
WINDOW_RULES = ("paper", "authors")  # paper: W positions after j; authors' code: W - 1 (both need j + W <= K)
MAX_SEED = 2**63 - 1  # seeds are any int64: [-2**63, 2**63 - 1]
MIN_SEED = -(2**63)
# A temperature below this is greedy (as vLLM's _SAMPLING_EPS): dividing logits by a subnormal
# temperature overflows to inf and the softmax to NaN, and no sampler can draw from that.
SAMPLING_EPS = 1e-5
# The most drafts a round may hold per row (k, k_max) and the longest window: the dense draft
# distribution costs k x vocab floats a row (64 x 151,936 x 4 B = 39 MB), and a round of more
# drafts than this never paid in any measurement (docs/journal.md).
MAX_K = 64
# Model-free draft sources (drafters.py): prompt lookup over the row's own tokens, the suffix index
# over earlier requests of this engine, Token Recycling from the target's own earlier top-k.
MLA_SOURCES = ("pld", "suffix", "recycle")
# How a drafter of another tokenizer drafts (drafting/cross_vocab.py): "tli" its distribution
# limited to the tokens both vocabularies share, "string" its text re-encoded by the target's
# tokenizer; "auto": TLI for a sampling row, the drafter's greedy method for a greedy one
CROSS_VOCAB = ("auto", *CROSS_VOCAB_METHODS)


SHOWN_CHARS = 64  # of a bad value echoed in its error: a client's megabyte is not sent back


def shown(value) -> str:
    """A value as an error message quotes it: its repr, cut to SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


# OpenAI's ranges: temperature in [0, 2], top_p in [0, 1], up to 4 stop strings. A stop string's
# length is ours to bound (OpenAI states none): what a stream holds back while its text may still
# become one, and what the engine thread matches against every round's text.
MAX_TEMPERATURE = 2.0
MAX_STOPS = 4
MAX_STOP_CHARS = 512


@dataclass(frozen=True)
class Mode:
    """What a mode drafts with, and how its drafts are judged."""

    name: str
    # How it drafts, k auto's kinds (round_cost.KINDS) and the engine's drafters by the same name:
    # None: no drafts (plain decoding); "pld": prompt lookup; "suffix": the suffix index over
    # earlier requests; "recycle": Token Recycling; "model": the draft model
    source: str | None
    loose: bool  # FLy's entropy gate and deferred window decide; False: strict (standard SPD)
    help: str


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("ar", None, False, "plain decoding of the target"),
        Mode("pld", "pld", False, "prompt lookup drafts for the target, strict"),
        Mode("suffix", "suffix", False, "drafts from a suffix index over earlier requests of this engine, strict"),
        Mode("recycle", "recycle", False, "Token Recycling: drafts from the target's own earlier top-k, strict"),
        Mode("spd", "model", False, "standard speculative decoding with the draft model"),
        Mode("fly", "model", True, "FLy: draft model, entropy gate and deferred window"),
    )
}


def knob(default, help: str, api: str | None = "fly", choices=None, **kw):
    """A Params field. api: "fly" (the request's `fly` object), "openai" (a top-level OpenAI
    field), None (engine only)."""
    meta = {"help": help, "api": api, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def default_window(k: int) -> int:
    """W when the request sets none: 6 (the paper's), but always < k so a window fits a round."""
    return max(0, min(6, k - 1))


@dataclass
class Params:
    mode: str = knob("fly", "decoding mode", choices=tuple(MODES))
    k: int | str = knob(
        15,
        'drafts per round (a cap), or "auto": each round the engine picks every row\'s k '
        "in 0..k_max for the most tokens per second (speculation_policy.py)",
    )
    k_max: int = knob(15, 'the cap of k when k is "auto" (a prompt-lookup copy under way may pass it: lookup_match.py)')
    theta: float = knob(0.3, "entropy gate: defer a mismatch only where the target's entropy >= theta; >= 1 is SPD")
    window: int | None = knob(
        None, "W: a deferred mismatch is kept if the next W positions match (default min(6, k - 1))"
    )
    entropy: str = knob("topk", "entropy the gate reads", choices=ENTROPIES)
    rho: float = knob(
        0.0,
        "plausibility guard: defer a mismatch only where the target's probability of the draft is "
        ">= rho times its top probability (0: off; 1: only drafts tied with the target's top)",
    )
    window_rule: str = knob("paper", "paper: W positions after a mismatch; authors: W - 1", choices=WINDOW_RULES)
    mla: bool = knob(True, "model drafter accelerated by prompt lookup")
    mla_sources: str = knob(
        "pld",
        "MLA proposal sources, comma-separated, tried in this order at each drafter forward (the first "
        f"that proposes wins): {', '.join(MLA_SOURCES)}",
    )
    drafter: str | None = knob(
        None,
        "the draft model to draft with, by the name the server gives it (GET /v1/fly/stats lists them); "
        "none: k auto picks each round among them (with a fixed k: the first)",
    )
    cross_vocab: str = knob(
        "auto",
        "how a drafter of another tokenizer drafts: tli (its distribution limited to the tokens both "
        "vocabularies share), string (its text re-encoded by the target's tokenizer; greedy drafts), "
        "auto (tli when sampling, else the drafter's own rule)",
        choices=CROSS_VOCAB,
    )
    temperature: float = knob(
        0.0, f"sampling temperature in [0, {MAX_TEMPERATURE:g}] (below {SAMPLING_EPS}: greedy)", api="openai"
    )
    top_p: float = knob(1.0, "nucleus sampling, in [0, 1] (0: the most likely token only)", api="openai")
    max_tokens: int = knob(256, "most tokens to generate", api="openai")
    stop: list[str] = knob([], f"stop strings, at most {MAX_STOPS} of {MAX_STOP_CHARS} characters each", api="openai")
    seed: int | None = knob(None, "seed of this request's random numbers", api="openai")
    # Structured output (grammar.py): at most one of the three; every mode honours it.
    response_format: dict | None = knob(
        None,
        'OpenAI\'s: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": {...}}}: the output is JSON (of that schema)',
        api="openai",
    )
    regex: str | None = knob(None, "the output matches this regular expression (whole)")
    grammar: str | None = knob(None, "the output is a sentence of this Lark grammar (llguidance's dialect)")

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ParamError(unknown[0], "unknown field")
        return cls(**d)

    def merged(self, overrides: dict) -> "Params":
        """These params (a profile's defaults) with a request's fields on top. A profile's window
        that does not fit under the request's k is dropped for the derived one (default_window):
        a request for k = 3 gets W = 2, not a 400 about a window it did not send."""
        out = Params.from_dict({**self.__dict__, **overrides})
        fits = not (is_int(out.window) and is_int(out.k_cap)) or out.window < out.k_cap
        if "window" not in overrides and not fits:
            out.window = None
        return out

    @property
    def mode_spec(self) -> Mode:
        return MODES[self.mode]

    @property
    def auto_k(self) -> bool:
        return self.k == "auto"

    @property
    def k_cap(self) -> int:
        """The most drafts a round may give this request."""
        return self.k_max if self.auto_k else self.k

    @property
    def mla_levels(self) -> tuple[str, ...]:
        """mla_sources as a tuple of names, in order."""
        return tuple(s.strip() for s in self.mla_sources.split(",")) if isinstance(self.mla_sources, str) else ()

    @property
    def effective_window(self) -> int:
        return default_window(self.k_cap) if self.window is None else self.window

    def validate(self, prompt_len: int, max_model_len: int) -> "Params":
        def bad(name, why):
            raise ParamError(name, f"{why} (got {shown(getattr(self, name))})")

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if prompt_len < 1:
            raise ParamError("prompt", "must not be empty")
        if self.mode not in MODES:
            bad("mode", f"must be one of {', '.join(MODES)}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if prompt_len >= max_model_len:  # the prompt alone leaves no room: its fault, whatever max_tokens
            raise ParamError(
                "prompt", f"{prompt_len} tokens leave no room in the context window of {max_model_len} tokens"
            )
        if prompt_len + self.max_tokens > max_model_len:
            bad(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens exceeds the context window of {max_model_len} tokens",
            )
        if not self.auto_k and (not is_int(self.k) or not 1 <= self.k <= MAX_K):
            bad("k", f'must be an integer in [1, {MAX_K}] or "auto"')
        if not is_int(self.k_max) or not 1 <= self.k_max <= MAX_K:
            bad("k_max", f"must be an integer in [1, {MAX_K}]")
        if not is_num(self.theta) or not 0 <= self.theta <= 1:
            bad("theta", "must be in [0, 1]")
        if not is_num(self.rho) or not 0 <= self.rho <= 1:
            bad("rho", "must be in [0, 1]")
        if self.window is not None and (not is_int(self.window) or not 0 <= self.window <= MAX_K):
            bad("window", f"must be an integer in [0, {MAX_K}]")
        if self.mode_spec.loose and self.effective_window >= self.k_cap:
            bad("window", f"must be < k ({self.k_cap})")
        if self.entropy not in ENTROPIES:
            bad("entropy", f"must be one of {', '.join(ENTROPIES)}")
        if self.window_rule not in WINDOW_RULES:
            bad("window_rule", f"must be one of {', '.join(WINDOW_RULES)}")
        if not is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}]")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0  # greedy (SAMPLING_EPS)
        if not is_num(self.top_p) or not 0 <= self.top_p <= 1:
            bad("top_p", "must be in [0, 1]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if len(self.stop) > MAX_STOPS:
            raise ParamError("stop", f"at most {MAX_STOPS} stop strings (got {len(self.stop)})")
        if (longest := max(map(len, self.stop), default=0)) > MAX_STOP_CHARS:
            raise ParamError("stop", f"a stop string is at most {MAX_STOP_CHARS} characters (got {longest})")
        if self.seed is not None and (not is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            bad("seed", f"must be an int64, in [{MIN_SEED}, {MAX_SEED}]")
        if not isinstance(self.mla, bool):
            bad("mla", "must be true or false")
        if self.response_format is not None and not isinstance(self.response_format, dict):
            bad("response_format", "must be an object")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                bad(name, "must be a string")
        if self.drafter is not None and (not isinstance(self.drafter, str) or not self.drafter):
            bad("drafter", "must be a drafter's name")
        if self.cross_vocab not in CROSS_VOCAB:
            bad("cross_vocab", f"must be one of {', '.join(CROSS_VOCAB)}")
        levels = self.mla_levels
        if not levels or any(s not in MLA_SOURCES for s in levels) or len(set(levels)) != len(levels):
            bad("mla_sources", f"must be distinct names from {', '.join(MLA_SOURCES)}, comma-separated")
        return self


def knobs(api: str | None = None):
    """The Params fields (dataclasses.Field) of one API group, or all of them."""
    return [f for f in fields(Params) if api is None or f.metadata.get("api") == api]
