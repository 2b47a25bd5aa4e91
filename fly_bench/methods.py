"""The methods a bench run compares, and how each turns prompts into outputs.

A method is written `name` or `name:key=value,key=value` (an ablation), e.g. `fly:theta=0.6,window=4`.
Engine methods are the engine's modes (params.MODES: ar, spd, pld, fly, ...) plus `fly-nomla`
(fly with mla=false); their keys are Params fields. An engine method's name may carry a runtime,
`name@torch` or `name@llama.cpp` (e.g. `ar@torch`, `fly@torch:k=6`): it then runs on a second
engine of the same pair on that runtime (built on first use), beside the run's default engine
(--runtime). Peers run transformers' own `generate` on the same models loaded in torch:
`hf-greedy` (plain decoding, a reference row), `hf-assisted` (assisted generation with the same
drafter as `assistant_model`) and `hf-pld` (prompt lookup, `prompt_lookup_num_tokens`, default
10); their keys are `generate` keyword arguments. llama.cpp's `llama-server` runs the same GGUF
files (llama_server.py): `llama-server` (the target alone), `llama-server-draft` (with the drafter,
llama.cpp's own speculative decoding) and `llama-server-ngram` (its n-gram drafts); their keys are
llama-server flags without the dashes (`llama-server-draft:spec-draft-n-max=16`).
"""

import time
from dataclasses import dataclass, field

from fly_serve.engine.params import MODES, ParamError, Params

from .timing import timed

ALIASES = {"fly-nomla": ("fly", {"mla": False})}
PEERS = {
    "hf-greedy": {},
    "hf-assisted": {},  # transformers' defaults: num_assistant_tokens 20, its own schedule
    "hf-pld": {"prompt_lookup_num_tokens": 10},
}
# llama.cpp's own defaults otherwise (a user's first command line): --spec-draft-n-max 3, n-gram sizes 12 / 48
LLAMA_SERVER_PEERS = {
    "llama-server": {},
    "llama-server-draft": {"spec-type": "draft-simple"},  # with --spec-draft-model: the run's drafter
    "llama-server-ngram": {"spec-type": "ngram-simple"},
}
# flags the bench sets itself, the same for every llama-server method (LlamaServer)
SERVER_FLAGS_SET = {"m", "model", "md", "model-draft", "spec-draft-model", "host", "port", "t", "threads"}
SERVER_FLAGS_SET |= {"np", "parallel", "c", "ctx-size"}
ENGINE_RUNTIMES = ("torch", "llama.cpp")


@dataclass(frozen=True)
class Method:
    label: str  # as written on the command line: the key of its results
    kind: str  # "engine", "hf" or "llama-server"
    base: str  # an engine mode or a peer name
    options: dict = field(default_factory=dict)  # Params overrides, generate kwargs, or llama-server flags
    runtime: str | None = None  # an engine method's runtime ("name@runtime"); None: the run's default

    @property
    def batch_sizes_allowed(self) -> tuple[int, ...] | None:
        """None: any batch size. transformers' assisted generation and prompt lookup run one
        sequence at a time, so the hf peers run at batch 1 only; llama-server batches its slots."""
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
    ttft_s: float | None = None  # llama-server only: its time to the first token, streamed
    timings: dict | None = None  # llama-server only: its own figures (predicted_per_second, draft_n, ...)


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
    """`name[@runtime][:key=value,...]` -> Method; a bad name or option is a ValueError naming both."""
    name, _, rest = spec.partition(":")
    name, at, runtime = name.partition("@")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"methods: {spec!r}: expected key=value, got {item!r}")
        options[key.strip()] = parse_value(value.strip())
    if name in ALIASES:
        name, preset = ALIASES[name]
        options = {**preset, **options}
    if at and (name in PEERS or name in LLAMA_SERVER_PEERS or runtime not in ENGINE_RUNTIMES):
        why = "a peer has its own runtime" if name in PEERS or name in LLAMA_SERVER_PEERS else "unknown runtime"
        raise ValueError(f"methods: {spec!r}: {why} (an engine method takes @{' or @'.join(ENGINE_RUNTIMES)})")
    if name in PEERS:
        return Method(spec, "hf", name, {**PEERS[name], **options})
    if name in LLAMA_SERVER_PEERS:
        taken = sorted(SERVER_FLAGS_SET & set(options))
        if taken:
            raise ValueError(f"methods: {spec!r}: {', '.join(taken)} is set by the bench for every llama-server method")
        return Method(spec, "llama-server", name, {**LLAMA_SERVER_PEERS[name], **options})
    if name not in MODES:
        known = ", ".join([*MODES, *ALIASES, *PEERS, *LLAMA_SERVER_PEERS])
        raise ValueError(f"methods: {spec!r}: unknown method {name!r} (have {known})")
    for reserved in ("mode", "max_tokens", "temperature", "seed", "stop"):
        if reserved in options:
            raise ValueError(f"methods: {spec!r}: {reserved} is set by the bench for every method")
    try:  # every option is checked now, not after an hour of other methods
        Params.from_dict({"mode": name, **options}).validate(1, 1 << 30)
    except (ParamError, TypeError) as e:
        raise ValueError(f"methods: {spec!r}: {e}") from None
    return Method(spec, "engine", name, options, runtime or None)


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


class ServerPeer:
    """llama.cpp's llama-server on the run's GGUF files: one server per llama-server method,
    started on its first use with `slots` slots (the run's largest batch) of `context` tokens and
    `threads` threads, kept for the run, stopped by close(). A chunk of b prompts is b requests
    at once (the server's continuous batching), its makespan shared evenly as the engine's is."""

    def __init__(self, target_gguf, drafter_gguf, threads: int, slots: int, context: int):
        self.target, self.drafter = target_gguf, drafter_gguf
        self.threads, self.slots, self.context = threads, slots, context
        self.servers: dict[str, object] = {}  # label -> a running llama_server.LlamaServer

    def server(self, method: Method):
        from .llama_server import LlamaServer

        if method.label not in self.servers:
            draft = method.base == "llama-server-draft"
            if draft and self.drafter is None:
                raise ValueError(f"methods: {method.label}: needs a draft model (--drafter)")
            server = LlamaServer(
                self.target,
                draft=self.drafter if draft else None,
                threads=self.threads,
                slots=self.slots,
                context=self.context,
                flags=method.options,
            )
            server.start()
            self.servers[method.label] = server
        return self.servers[method.label]

    def generate(self, method: Method, prompts: list[list[int]], settings: list[dict]) -> list[Output]:
        server = self.server(method)
        asks = [
            dict(
                max_tokens=s["max_tokens"],
                temperature=s.get("temperature", 0.0),
                seed=s.get("seed") or 0,
                stop=s.get("stop") or [],
            )
            for s in settings
        ]
        answers, makespan = server.complete_many(prompts, asks)
        share = makespan / len(answers)
        return [
            Output(a.token_ids, a.text, share, finish_reason=a.finish_reason, ttft_s=a.ttft_s, timings=a.timings)
            for a in answers
        ]

    def commands(self) -> dict[str, str]:
        """Each started server's command line, by method."""
        return {label: s.command for label, s in self.servers.items()}

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
