"""The methods a bench run compares, and how each turns prompts into outputs.

A method is written `name` or `name:key=value,key=value` (an ablation), e.g. `fly:theta=0.6,window=4`.
Engine methods are the engine's modes (params.MODES: ar, spd, pld, fly, ...) plus `fly-nomla`
(fly with mla=false); their keys are Params fields. Peers run transformers' own `generate` on the
same loaded models: `hf-greedy` (plain decoding, a reference row), `hf-assisted` (assisted
generation with the same drafter as `assistant_model`) and `hf-pld` (prompt lookup,
`prompt_lookup_num_tokens`, default 10); their keys are `generate` keyword arguments.
"""

import time
from dataclasses import dataclass, field

from fly_serve.params import MODES, ParamError, Params

from .timing import timed

ALIASES = {"fly-nomla": ("fly", {"mla": False})}
PEERS = {
    "hf-greedy": {},
    "hf-assisted": {},  # transformers' defaults: num_assistant_tokens 20, its own schedule
    "hf-pld": {"prompt_lookup_num_tokens": 10},
}


@dataclass(frozen=True)
class Method:
    label: str  # as written on the command line: the key of its results
    kind: str  # "engine" or "hf"
    base: str  # an engine mode or a peer name
    options: dict = field(default_factory=dict)  # Params overrides, or generate kwargs

    @property
    def batch_sizes_allowed(self) -> tuple[int, ...] | None:
        """None: any batch size. transformers' assisted generation and prompt lookup run one
        sequence at a time, so the peers run at batch 1 only."""
        return (1,) if self.kind == "hf" else None


@dataclass
class Output:
    token_ids: list[int]
    text: str
    wall_s: float  # this sample's share of its batch's wall time
    rounds: int | None = None  # engine only: rounds, drafted, accepted, loosely accepted
    drafted: int | None = None
    accepted: int | None = None
    loosely: int | None = None
    finish_reason: str | None = None
    # engine only: the output position (0-based) of the first loosely accepted token (the engine's
    # RequestStats.first_loose_pos); None: none reached the output
    first_loose_pos: int | None = None


def parse_value(text: str):
    low = text.lower()
    if low in ("true", "false", "on", "off"):
        return low in ("true", "on")
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> Method:
    """`name[:key=value,...]` -> Method; a bad name or option is a ValueError naming both."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"methods: {spec!r}: expected key=value, got {item!r}")
        options[key.strip()] = parse_value(value.strip())
    if name in ALIASES:
        name, preset = ALIASES[name]
        options = {**preset, **options}
    if name in PEERS:
        return Method(spec, "hf", name, {**PEERS[name], **options})
    if name not in MODES:
        known = ", ".join([*MODES, *ALIASES, *PEERS])
        raise ValueError(f"methods: {spec!r}: unknown method {name!r} (have {known})")
    for reserved in ("mode", "max_tokens", "temperature", "seed", "stop"):
        if reserved in options:
            raise ValueError(f"methods: {spec!r}: {reserved} is set by the bench for every method")
    try:  # every option is checked now, not after an hour of other methods
        Params.from_dict({"mode": name, **options}).validate(1, 1 << 30)
    except (ParamError, TypeError) as e:
        raise ValueError(f"methods: {spec!r}: {e}") from None
    return Method(spec, "engine", name, options)


# ---- running
def run_engine(engine, method: Method, prompts: list[list[int]], settings: list[dict]) -> list[Output]:
    """All prompts as one batch of the engine (timing.timed); settings: per prompt max_tokens,
    temperature, seed, stop. Wall time is shared evenly by the batch's samples."""
    outs = []
    for t in timed(engine, prompts, [{"mode": method.base, **method.options, **s} for s in settings]):
        if t.finish_reason == "error":
            raise RuntimeError(f"{method.label}: request failed: {t.error}")
        outs.append(
            Output(
                t.ids, t.text, t.wall_s, t.rounds, t.drafted, t.accepted, t.loosely, t.finish_reason, t.first_loose_pos
            )
        )
    return outs


@dataclass
class Peer:
    """transformers' generate on the engine's own loaded models (same weights, same precision)."""

    target: object
    drafter: object | None
    tokenizer: object
    eos_ids: list[int]

    def generate(self, method: Method, prompt: list[int], setting: dict) -> Output:
        import torch

        # the engine applies no repetition penalty; a pair's generation_config may (Qwen's hub one does)
        kwargs = {"repetition_penalty": 1.0, **method.options}
        if method.base == "hf-assisted":
            if self.drafter is None:
                raise ValueError(f"methods: {method.label}: needs a draft model")
            kwargs["assistant_model"] = self.drafter
        if setting.get("temperature", 0) > 0:
            kwargs.update(do_sample=True, temperature=float(setting["temperature"]), top_p=1.0, top_k=0)
            torch.manual_seed(setting.get("seed") or 0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if setting.get("stop"):
            # a criterion, not stop_strings=: assisted generation hands stop_strings on to the
            # assistant's own generate without the tokenizer, which then refuses to start
            from transformers import StoppingCriteriaList, StopStringCriteria

            stop = StopStringCriteria(tokenizer=self.tokenizer, stop_strings=setting["stop"])
            kwargs["stopping_criteria"] = StoppingCriteriaList([stop])
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=setting["max_tokens"],
                eos_token_id=self.eos_ids,
                pad_token_id=self.eos_ids[0],
                **kwargs,
            )
        wall = time.perf_counter() - t0
        gen = out[0, len(prompt) :].tolist()
        cut = next((i for i, t in enumerate(gen) if t in self.eos_ids), len(gen))
        finish = "stop" if cut < len(gen) else "length"
        gen = gen[:cut]
        text = self.tokenizer.decode(gen, skip_special_tokens=True)
        for s in setting.get("stop") or []:
            if s in text:
                text, finish = text[: text.find(s)], "stop"
        return Output(gen, text, wall, finish_reason=finish)
