"""Per-request knobs, checked up front: a bad value is a ValueError that names the field."""
from dataclasses import dataclass, field, fields

from .verify import ENTROPIES, WINDOW_RULES

MODES = ("ar", "spd", "fly", "pld")  # plain decoding, standard SPD, FLy, prompt lookup alone


@dataclass
class Params:
    mode: str = "fly"
    k: int = 15  # drafts per round (measured on the default pair: README, "Measurements")
    theta: float = 0.3  # entropy gate: defer a mismatch only where the target's entropy >= theta
    window: int = 6  # W: a deferred mismatch is kept if the next W positions match
    entropy: str = "topk"  # "topk": top-3 entropy in nats; "full": normalized full-vocabulary
    window_rule: str = "paper"  # "paper": W positions after j; "authors": W - 1
    mla: bool = True  # model drafter accelerated by prompt lookup
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Params":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown field")
        return cls(**d)

    def validate(self, prompt_len: int, max_model_len: int) -> "Params":
        def bad(name, why):
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if prompt_len < 1:
            raise ValueError("prompt: must not be empty")
        if self.mode not in MODES:
            bad("mode", f"must be one of {', '.join(MODES)}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if prompt_len + self.max_tokens > max_model_len:
            bad("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens exceeds the context window "
                              f"of {max_model_len} tokens")
        if not is_int(self.k) or self.k < 1:
            bad("k", "must be an integer >= 1")
        if not isinstance(self.theta, (int, float)) or not 0 <= self.theta <= 1:
            bad("theta", "must be in [0, 1]")
        if not is_int(self.window) or self.window < 0:
            bad("window", "must be an integer >= 0")
        if self.mode == "fly" and self.window >= self.k:
            bad("window", f"must be < k ({self.k})")
        if self.entropy not in ENTROPIES:
            bad("entropy", f"must be one of {', '.join(ENTROPIES)}")
        if self.window_rule not in WINDOW_RULES:
            bad("window_rule", f"must be one of {', '.join(WINDOW_RULES)}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100]")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer")
        if not isinstance(self.mla, bool):
            bad("mla", "must be true or false")
        return self
