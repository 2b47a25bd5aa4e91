"""The one engine factory. Parts are built here from an EngineConfig (`load_scorer`,
`load_drafter`: the target and drafter replicas call them too), and `assemble_engine` puts an
Engine together from parts built anywhere (local models, or the Serve ingress's remote proxies),
so the tokenizer check, the max_model_len clamp and the EOS ids are written once."""

from dataclasses import fields, replace

import torch

from .config import EngineConfig
from .contracts import Drafter, ModelRunner, Scorer
from .decision.grammar import Grammars
from .drafting.drafters import ModelDrafter
from .engine.engine import Engine
from .engine.params import Params
from .k_auto.cost_calibration import calibrate_engine, calibration_key, model_name
from .loading.head_cut import check_head_cut
from .loading.loading import eos_ids, load_config, load_model, load_tokenizer
from .loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, check_same_tokenizer
from .runtime.llama_runner import GGUFModel, LlamaRunner
from .runtime.model_scorer import ModelScorer
from .runtime.runner import Runner


def logit_width(model) -> int:
    return model.n_vocab if isinstance(model, GGUFModel) else model.config.vocab_size


def check_widths(target_model, drafter_model, tokenizer) -> None:
    """Pairs may differ in logit width (Qwen2.5 0.5B: 151,936; 7B and larger: 152,064) as long as
    both cover every token the tokenizer can produce; both are cut to the tokenizer's tokens."""
    n = len(tokenizer)
    for role, model in (("target", target_model), ("drafter", drafter_model)):
        if logit_width(model) < n:
            raise ValueError(f"{role}: {logit_width(model)} logits cannot cover the tokenizer's {n} tokens")


def runner_for(model, config: EngineConfig, budget_tokens: int | None, tp_group=None) -> ModelRunner:
    """A loaded model with its KV cache: on llama.cpp's kernels for a GGUF model (its threads this
    process's torch setting, loading.set_threads), else on torch's."""
    if isinstance(model, GGUFModel):
        return LlamaRunner(
            model,
            n_slots=config.max_batch,
            budget_tokens=budget_tokens,
            prefix_cache=config.prefix_cache,
            threads=torch.get_num_threads(),
        )
    return Runner(
        model,
        n_slots=config.max_batch,
        tp_group=tp_group,
        budget_tokens=budget_tokens,
        prefix_cache=config.prefix_cache,
    )


def scorer_for(model, config: EngineConfig, vocab_size: int, tp_group=None, sample: bool = True) -> ModelScorer:
    """sample: False on TP ranks above 0, whose verdicts nobody reads (they skip the sampling)."""
    return ModelScorer(runner_for(model, config, config.target_budget, tp_group), vocab_size=vocab_size, sample=sample)


def drafter_for(model, config: EngineConfig, vocab_size: int) -> ModelDrafter:
    return ModelDrafter(
        runner_for(model, config, config.drafter_budget),
        min_confidence=config.draft_min_confidence,
        vocab_size=vocab_size,
        loop=config.draft_loop,
    )


def load_scorer(
    config: EngineConfig, rank: int = 0, world: int = 1, tp_group=None, device=None, progress=print
) -> ModelScorer:
    """The target (rank `rank` of `world` shards) as a scorer, on `device` (devices.py; None: this
    process's). Every rank gets the same token budget, so that the ranks take the same block
    decisions."""
    model = load_model(
        config.target, config.dtype, rank, world, progress=progress, device=device, runtime=config.runtime
    )
    return scorer_for(model, config, len(load_tokenizer(config.target, progress)), tp_group, sample=rank == 0)


def load_drafter(config: EngineConfig, device=None, progress=print) -> ModelDrafter:
    """The draft model, its logits cut to the tokenizer's tokens as the target's are."""
    check_head_cut(config.drafter_head_cut, "drafter_head_cut")
    model = load_model(
        config.drafter,
        config.drafter_precision,
        progress=progress,
        head_cut=config.drafter_head_cut,
        device=device,
        runtime=config.runtime,
    )
    return drafter_for(model, config, len(load_tokenizer(config.drafter, progress)))


def grammars_for(config: EngineConfig, progress=print) -> Grammars:
    """The grammar side of a drafter loaded alone (a drafter replica), as its engine's
    (assemble_engine): the pair's tokenizer and the target's EOS ids, its tokenizer built now."""
    tokenizer = load_tokenizer(config.target, progress)
    grammars = Grammars(tokenizer, len(tokenizer), eos_ids(config.target, tokenizer))
    grammars.warm()
    return grammars


def assemble_engine(
    config: EngineConfig, scorer: Scorer, drafter: Drafter | None, tokenizer, target_model=None, progress=print
) -> Engine:
    """An Engine from built parts. target_model: the loaded target when there is one here (else
    its config and generation config are read by name). A drafter named in the config must share
    the target's tokenizer: speculative decoding compares token ids."""
    if drafter is not None and isinstance(config.drafter, str):
        check_same_tokenizer(tokenizer, load_tokenizer(config.drafter, progress))
    if isinstance(target_model, GGUFModel):  # its config and EOS ids are read by name
        target_model = None
    model_config = target_model.config if target_model is not None else load_config(config.target, progress)
    engine = Engine(
        scorer,
        drafter,
        tokenizer,
        eos_ids(target_model if target_model is not None else config.target, tokenizer),
        max_batch=config.max_batch,
        max_model_len=min(config.max_model_len, model_config.max_position_embeddings),
        defaults=config.params(),
        speculation_profile=config.speculation_profile,
        draft_ahead=config.draft_ahead,
        draft_threads=config.draft_threads,
        verify_threads=config.verify_threads,
    )
    engine.grammars.warm()  # now (about 2 s at 152k tokens), not in the first constrained request's round
    return engine


def with_knobs(config: EngineConfig, knobs: dict) -> EngineConfig:
    """config with these EngineConfig fields replaced; an unknown name is a TypeError naming it.
    defaults may be given as Params."""
    unknown = sorted(set(knobs) - {f.name for f in fields(EngineConfig)})
    if unknown:
        raise TypeError(f"build_engine: no knob named {', '.join(unknown)} (EngineConfig's fields are the knobs)")
    if isinstance(knobs.get("defaults"), Params):
        knobs = {**knobs, "defaults": dict(knobs["defaults"].__dict__)}
    elif "defaults" in knobs:
        knobs = {**knobs, "defaults": dict(knobs["defaults"] or {})}
    return replace(config, **knobs)


def build_engine(
    target=DEFAULT_TARGET,
    drafter=DEFAULT_DRAFTER,
    *,
    tokenizer=None,
    config: EngineConfig | None = None,
    device=None,
    calibrate: bool | None = None,
    progress=print,
    **knobs,
) -> Engine:
    """target / drafter: a model name (loading.py) or a loaded model; drafter None: no draft
    model (model-free modes only). With a loaded target, pass its tokenizer. `config`: every
    other knob (EngineConfig); `knobs`: EngineConfig's fields by name, over `config` (or over its
    defaults), for callers without one: a knob is named, defaulted and documented once, there.
    device: where models given by name load (default: this process's, devices.local_device).
    A drafter_head_cut is refused with a loaded drafter (cut that with head_cut.cut_head).
    k "auto"'s cost profile: speculation_profile if given (an override), else measured here
    (cost_calibration.py; cached per machine, models and versions) when calibrate is True, or
    None and the defaults use k "auto"; otherwise the uncalibrated default shape, which the
    policy's cost check corrects from the first rounds (calibrate_engine can still be called)."""
    config = with_knobs(config or EngineConfig(), knobs)
    check_head_cut(config.drafter_head_cut, "drafter_head_cut")
    names = model_name(target), model_name(drafter)  # for the calibration's key, before loading
    # loaded models are not names: the config keeps names only (None for a loaded part)
    config = replace(
        config,
        target=target if isinstance(target, str) else None,
        drafter=drafter if isinstance(drafter, str) else None,
    )
    if tokenizer is None:
        if config.target is None:
            raise ValueError("tokenizer: required when the target is an already-loaded model")
        tokenizer = load_tokenizer(config.target, progress)
    if isinstance(target, str):
        target_model = load_model(target, config.dtype, progress=progress, device=device, runtime=config.runtime)
    else:
        target_model = target
    draft = None
    if drafter is not None:
        if isinstance(drafter, str):
            check_same_tokenizer(tokenizer, load_tokenizer(drafter, progress))
            drafter = load_model(
                drafter,
                config.drafter_precision,
                progress=progress,
                head_cut=config.drafter_head_cut,
                device=device,
                runtime=config.runtime,
            )
        elif config.drafter_head_cut is not None:  # cutting a caller's model in place would surprise it
            raise ValueError("drafter_head_cut: only for a drafter given by name (cut a loaded one: head_cut.cut_head)")
        check_widths(target_model, drafter, tokenizer)
        draft = drafter_for(drafter, config, len(tokenizer))
    # the drafter's tokenizer was checked above, against whatever tokenizer the caller gave
    engine = assemble_engine(
        replace(config, drafter=None),
        scorer_for(target_model, config, len(tokenizer)),
        draft,
        tokenizer,
        target_model,
        progress,
    )
    if config.speculation_profile is None and (engine.defaults.auto_k if calibrate is None else calibrate):
        key = calibration_key(config, engine.defaults.k_max, target=names[0], drafter=names[1])
        calibrate_engine(engine, key, progress=progress)
    return engine
