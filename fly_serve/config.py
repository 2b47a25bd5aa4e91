"""The one configuration of an engine (vLLM's habit: one config object handed down). The
in-process factory (`build.build_engine`), the Serve app (`deployments.profiles.app_args.AppArgs.engine_config`)
and the replicas that load a part read the same fields, so a knob is named and defaulted once."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .contracts import CROSS_VOCAB_METHODS
from .engine.params import Params
from .loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, drafter_model, drafter_short_name


@dataclass(frozen=True)
class DrafterSpec:
    """One named draft model of an engine: the model (a name loading.py knows, or a short name of
    weights.DRAFTERS), and, for one of another tokenizer, how it drafts greedy rows (cross_vocab.py:
    "string" re-encodes its text, "tli" drafts only the tokens both vocabularies share)."""

    model: str
    greedy: str = "string"

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"drafters: a drafter's model must be a model name (got {self.model!r})")
        if self.greedy not in CROSS_VOCAB_METHODS:
            raise ValueError(f"drafters: greedy must be one of {', '.join(CROSS_VOCAB_METHODS)} (got {self.greedy!r})")
        object.__setattr__(self, "model", drafter_model(self.model))

    @classmethod
    def coerce(cls, spec) -> "DrafterSpec":
        if isinstance(spec, DrafterSpec):
            return spec
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {"model", "greedy"})
            if unknown:
                raise ValueError(f"drafters: unknown field {unknown[0]!r} of a drafter (model, greedy)")
            return cls(**spec)
        return cls(spec)


if TYPE_CHECKING:
    from .k_auto.round_cost import CostProfile

# What drafter_precision "auto" means for a drafter on torch on a CPU: dynamic int8 (the drafter
# only proposes; strict verification keeps the output the target's).
DRAFTER_CPU_AUTO = "int8"
# And on llama.cpp: the GGUF file requantized to Q4_0 once, where it ships heavier and the Q4_0
# form keeps its confident choices (loading/gguf_requant.py; the target always runs as shipped).
DRAFTER_GGUF_AUTO = "q4_0"


@dataclass(frozen=True)
class EngineConfig:
    target: str = DEFAULT_TARGET  # a model name (loading.py), "tiny:<seed>" for tests
    drafter: str | None = DEFAULT_DRAFTER  # None: no draft model (model-free modes only)
    # Several draft models by name, the first the default (`drafter` then unused): {name: model}
    # or {name: {"model": ..., "greedy": "string" | "tli"}} (DrafterSpec); a request picks one by
    # name (Params.drafter), else k auto chooses per row
    drafters: dict | None = None
    # The target's and the drafter's precision. "auto": the runtime's own (llama.cpp: the target's
    # GGUF file as shipped, a drafter's requantized to Q4_0 where faithful; torch: loading.resolve_precision, a
    # drafter int8 on a CPU). A torch precision is applied (runtime auto then loads that model on
    # torch) or refused (runtime llama.cpp); a drafter's q4_0 or shipped is llama.cpp's, refused
    # on torch: never silently ignored (loading.resolve_runtime).
    dtype: str = "auto"
    drafter_precision: str = "auto"
    drafter_head_cut: int | None = None  # cut the drafter's lm_head to ids below this (head_cut.py)
    max_batch: int = 8  # sequences per round; also the KV caches' slots
    max_model_len: int = 4096  # clamped to the target's max_position_embeddings
    defaults: dict = field(default_factory=dict)  # Params defaults (mode, k, theta, max_tokens ...)
    draft_min_confidence: float = 0.0
    speculation_profile: "CostProfile | dict | None" = None  # k "auto"'s round cost model (`fly-serve tune-k`)
    # Tokens each KV cache holds, all sequences together (target on every TP rank alike, drafter);
    # None: max_batch sequences of 4096 tokens. The target's and the drafter's own budgets, when
    # set, win: on a small GPU beside a large drafter the two must be sized apart.
    kv_budget_tokens: int | None = None
    target_kv_budget_tokens: int | None = None
    drafter_kv_budget_tokens: int | None = None
    # Draft-ahead (draft_ahead.py): the drafter drafts the next round while the target verifies
    # this one, on two threads; outputs are unchanged. draft_threads / verify_threads: each
    # side's torch threads (0: the process's setting).
    draft_ahead: bool = False
    draft_threads: int = 0
    verify_threads: int = 0
    # Share full KV blocks between sequences with the same token prefix (kv_cache.py), on the
    # target (every TP rank) and the drafter; off: every request prefills its whole prompt.
    prefix_cache: bool = False
    # llama.cpp's kernels chosen so that a position's logits do not depend on the forward's shape
    # (llama_runner.py, "Reproducible"): one text per greedy request however rounds and batches
    # fall, at a speed cost measured in docs/benchmarks.md. Process-wide; the torch runtime's
    # exactness is fp32's (docs/tuning.md).
    reproducible: bool = False
    # llama.cpp: a forward of a few tokens split into several calls where this machine measured
    # that cheaper (runtime/forward_widths.py: once per machine and model, cached); off: one call.
    forward_split: bool = True
    # The model drafter's loop (drafters.draft_loop): "mla" (prompt lookup proposals checked in
    # every forward: a CPU's, where a forward costs far more than the host's work), "fixed"
    # (fixed_loop.py: one-token steps on static shapes, no host read inside: a GPU's, the steps
    # replayed from CUDA graphs), "auto" (fixed on CUDA, mla elsewhere)
    draft_loop: str = "auto"
    # The models' runtime (loading.resolve_runtime): "auto" runs a model that ships as GGUF on
    # llama.cpp's CPU kernels (llama_runner.py; the drafter at drafter_precision) and everything
    # else on torch (GPUs, TP, checkpoints, tiny test models); "torch" or "llama.cpp" to choose.
    runtime: str = "auto"

    def params(self) -> Params:
        return Params.from_dict(self.defaults)

    def drafter_specs(self) -> dict[str, DrafterSpec]:
        """The engine's draft models by name, the default first: `drafters`, else `drafter` alone
        under its short name ({} without one)."""
        if self.drafters:
            return {str(name): DrafterSpec.coerce(spec) for name, spec in self.drafters.items()}
        if self.drafter is None:
            return {}
        return {drafter_short_name(drafter_model(self.drafter)): DrafterSpec(self.drafter)}

    @property
    def target_budget(self) -> int | None:
        return self.target_kv_budget_tokens or self.kv_budget_tokens

    @property
    def drafter_budget(self) -> int | None:
        return self.drafter_kv_budget_tokens or self.kv_budget_tokens
