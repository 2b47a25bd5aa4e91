"""The one engine factory. Parts are built here from an EngineConfig (`load_scorer`,
`load_drafter`: the target and drafter replicas call them too), and `assemble_engine` puts an
Engine together from parts built anywhere (local models, or the Serve ingress's remote proxies),
so the max_model_len clamp and the EOS ids are written once.

A drafter whose tokenizer is the target's drafts in the target's ids (drafters.ModelDrafter); one
of another tokenizer drafts through the pair's vocabulary map (drafting/cross_vocab.py), built
once per pair and cached (`drafter_part`). An engine may hold several drafters by name
(EngineConfig.drafters)."""

from dataclasses import fields, replace
from pathlib import Path

import torch

from .config import DRAFTER_CPU_AUTO, DRAFTER_GGUF_AUTO, DrafterSpec, EngineConfig
from .contracts import Drafter, ModelRunner, Scorer
from .decision.grammar import Grammars
from .drafting.cross_vocab import CrossVocabDrafter
from .drafting.drafters import ModelDrafter
from .drafting.vocab_map import VocabMap
from .engine.engine import DEFAULT_DRAFTER_NAME, Engine
from .engine.params import Params
from .k_auto.cost_calibration import calibrate_engine, calibration_key, machine, model_name, versions
from .loading.head_cut import check_head_cut
from .loading.loading import eos_ids, load_config, load_model, load_tokenizer
from .loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET, cache_dir, check_same_tokenizer
from .runtime import forward_widths
from .runtime.llama_runner import GGUFModel, LlamaRunner, set_reproducible
from .runtime.model_scorer import ModelScorer
from .runtime.runner import Runner


def logit_width(model) -> int:
    return model.n_vocab if isinstance(model, GGUFModel) else model.config.vocab_size


def check_widths(target_model, drafter_model, tokenizer, drafter_tokenizer=None) -> None:
    """Pairs may differ in logit width (Qwen2.5 0.5B: 151,936; 7B and larger: 152,064) as long as
    both cover every token their tokenizer can produce; both are cut to the tokenizer's tokens.
    drafter_tokenizer: the drafter's own, where it is not the target's."""
    for role, model, tok in (
        ("target", target_model, tokenizer),
        ("drafter", drafter_model, drafter_tokenizer or tokenizer),
    ):
        if logit_width(model) < len(tok):
            raise ValueError(f"{role}: {logit_width(model)} logits cannot cover the tokenizer's {len(tok)} tokens")


def same_tokenizer(target_tok, drafter_tok) -> bool:
    """Whether the drafter tokenizes exactly as the target (weights.check_same_tokenizer)."""
    try:
        check_same_tokenizer(target_tok, drafter_tok)
        return True
    except ValueError:
        return False


def drafter_part(inner: ModelDrafter, target_tok, drafter_tok, spec: DrafterSpec) -> Drafter:
    """The drafter as the engine drafts with it: itself where it shares the target's tokenizer,
    else through the pair's vocabulary map (cross_vocab.py; the map cached per pair)."""
    if same_tokenizer(target_tok, drafter_tok):
        return inner
    vmap = VocabMap.between(target_tok, drafter_tok, cache_dir())
    return CrossVocabDrafter(inner, vmap, target_tok, drafter_tok, greedy=spec.greedy, vocab_size=len(target_tok))


def runner_for(model, config: EngineConfig, budget_tokens: int | None, tp_group=None) -> ModelRunner:
    """A loaded model with its KV cache: on llama.cpp's kernels for a GGUF model (its threads this
    process's torch setting, loading.set_threads), else on torch's."""
    if isinstance(model, GGUFModel):
        runner = LlamaRunner(
            model,
            n_slots=config.max_batch,
            budget_tokens=budget_tokens,
            prefix_cache=config.prefix_cache,
            threads=torch.get_num_threads(),
        )
        if config.forward_split and not runner.reproducible:
            cache = cache_dir() / "forward-widths"
            runner.set_widths(forward_widths.cached_plan(runner, widths_key(model, runner), cache))
        return runner
    return Runner(
        model,
        n_slots=config.max_batch,
        tp_group=tp_group,
        budget_tokens=budget_tokens,
        prefix_cache=config.prefix_cache,
    )


def widths_key(model: GGUFModel, runner: LlamaRunner) -> dict:
    """What a forward's cost by width depends on (forward_widths.py): the machine, the model file,
    its weights' layout, the threads, the versions."""
    path = Path(model.path)
    return {
        "machine": machine(),
        "model": path.name,
        "bytes": path.stat().st_size,
        "repacked": model.repacked,
        "threads": runner.threads,
        "max_width": forward_widths.MAX_WIDTH,
        "versions": versions(),
    }


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
    set_reproducible(config.reproducible)
    model = load_model(
        config.target, config.dtype, rank, world, progress=progress, device=device, runtime=config.runtime, knob="dtype"
    )
    return scorer_for(model, config, len(load_tokenizer(config.target, progress)), tp_group, sample=rank == 0)


def load_drafter(config: EngineConfig, device=None, progress=print, name: str | None = None) -> Drafter:
    """A draft model by its name in the config (None: the default, the first), its logits cut to
    its tokenizer's tokens as the target's are; one of another tokenizer through the pair's
    vocabulary map (drafter_part)."""
    check_head_cut(config.drafter_head_cut, "drafter_head_cut")
    set_reproducible(config.reproducible)
    specs = config.drafter_specs()
    if not specs:
        raise ValueError("drafter: this config has no draft model")
    if name is not None and name not in specs:
        raise ValueError(f"drafter: no drafter named {name!r} (drafters: {', '.join(specs)})")
    spec = specs[name] if name is not None else next(iter(specs.values()))
    model = load_drafter_model(spec.model, config, device, progress)
    drafter_tok = load_tokenizer(spec.model, progress)
    inner = drafter_for(model, config, len(drafter_tok))
    return drafter_part(inner, load_tokenizer(config.target, progress), drafter_tok, spec)


def drafts_under_grammar(config: EngineConfig, name: str | None = None, target_tok=None, progress=print) -> bool:
    """Whether the named drafter (None: the default), as load_drafter builds it, drafts under a
    row's grammar: one of the target's tokenizer does (drafters.ModelDrafter), one of another does
    not (cross_vocab.py: grammars speak the target's ids). Read off the tokenizers alone, for a
    drafter that runs in replicas of its own (the ingress's remote_parts.RemoteDrafter)."""
    specs = config.drafter_specs()
    spec = specs[name] if name is not None else next(iter(specs.values()))
    target_tok = target_tok if target_tok is not None else load_tokenizer(config.target, progress)
    return same_tokenizer(target_tok, load_tokenizer(spec.model, progress))


def grammars_for(config: EngineConfig, progress=print) -> Grammars:
    """The grammar side of a drafter loaded alone (a drafter replica), as its engine's
    (assemble_engine): the pair's tokenizer and the target's EOS ids, its tokenizer built now."""
    tokenizer = load_tokenizer(config.target, progress)
    grammars = Grammars(tokenizer, len(tokenizer), eos_ids(config.target, tokenizer))
    grammars.warm()
    return grammars


def assemble_engine(
    config: EngineConfig,
    scorer: Scorer,
    drafter: Drafter | dict[str, Drafter] | None,
    tokenizer,
    target_model=None,
    progress=print,
) -> Engine:
    """An Engine from built parts. drafter: one, or several by name (the first the default).
    target_model: the loaded target when there is one here (else its config and generation config
    are read by name). A drafter of another tokenizer drafts through the pair's vocabulary map
    (load_drafter and build_engine wrap it: drafter_part)."""
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
    Several drafters: drafter a dict {name: model name, loaded model or DrafterSpec}, the first
    the default (EngineConfig.drafters, where set, wins over drafter); a request picks one by
    name, else k auto chooses per row. A drafter given by name may have another tokenizer than
    the target's (cross_vocab.py); a loaded one of another tokenizer comes as (model, tokenizer).
    k "auto"'s cost profile: speculation_profile if given (an override), else measured here
    (cost_calibration.py; cached per machine, models and versions) when calibrate is True, or
    None and the defaults use k "auto"; otherwise the uncalibrated default shape, which the
    policy's cost check corrects from the first rounds (calibrate_engine can still be called)."""
    config = with_knobs(config or EngineConfig(), knobs)
    check_head_cut(config.drafter_head_cut, "drafter_head_cut")
    set_reproducible(config.reproducible)  # before any model loads: it picks llama.cpp's kernels
    named = _named_drafters(config.drafters or drafter, config)
    # for the calibration's key, before loading: the names of the parts as given
    names = model_name(target), {n: spec if isinstance(m, str) else m for n, (m, spec) in named.items()}
    # loaded models are not names: the config keeps names only (None for a loaded part)
    config = replace(config, target=target if isinstance(target, str) else None, drafter=None, drafters=None)
    if tokenizer is None:
        if config.target is None:
            raise ValueError("tokenizer: required when the target is an already-loaded model")
        tokenizer = load_tokenizer(config.target, progress)
    if isinstance(target, str):
        target_model = load_model(
            target, config.dtype, progress=progress, device=device, runtime=config.runtime, knob="dtype"
        )
    else:
        target_model = target
    drafts = {
        name: _drafter(target_model, model, spec, config, tokenizer, device, progress)
        for name, (model, spec) in named.items()
    }
    engine = assemble_engine(
        config, scorer_for(target_model, config, len(tokenizer)), drafts or None, tokenizer, target_model, progress
    )
    if config.speculation_profile is None and (engine.defaults.auto_k if calibrate is None else calibrate):
        key = calibration_key(config, engine.defaults.k_max, target=names[0], drafters=names[1])
        calibrate_engine(engine, key, progress=progress)
    return engine


def _named_drafters(drafter, config: EngineConfig) -> dict[str, tuple]:
    """build_engine's drafters by name: (model name or loaded model, DrafterSpec) each."""
    if drafter is None:
        return {}
    if isinstance(drafter, dict):
        out = {}
        for name, d in drafter.items():
            if isinstance(d, (str, dict, DrafterSpec)):
                spec = DrafterSpec.coerce(d)
                out[str(name)] = (spec.model, spec)
            else:
                out[str(name)] = (d, DrafterSpec("loaded"))
        return out
    if isinstance(drafter, str):
        (name, spec), *_ = replace(config, drafter=drafter, drafters=None).drafter_specs().items()
        return {name: (spec.model, spec)}
    return {DEFAULT_DRAFTER_NAME: (drafter, DrafterSpec("loaded"))}


def load_drafter_model(name: str, config: EngineConfig, device, progress):
    """A draft model by name at the config's drafter precision, head cut and runtime."""
    return load_model(
        name,
        config.drafter_precision,
        progress=progress,
        head_cut=config.drafter_head_cut,
        device=device,
        runtime=config.runtime,
        knob="drafter_precision",
        cpu_auto=DRAFTER_CPU_AUTO,
        gguf_auto=DRAFTER_GGUF_AUTO,
    )


def _drafter(target_model, model, spec: DrafterSpec, config: EngineConfig, tokenizer, device, progress):
    """One drafter of build_engine: loaded by name (with its own tokenizer), or as given (a model
    of the target's tokenizer, or (model, tokenizer))."""
    if isinstance(model, str):
        drafter_tok = load_tokenizer(model, progress)
        model = load_drafter_model(model, config, device, progress)
        check_widths(target_model, model, tokenizer, drafter_tok)
        return drafter_part(drafter_for(model, config, len(drafter_tok)), tokenizer, drafter_tok, spec)
    if config.drafter_head_cut is not None:  # cutting a caller's model in place would surprise it
        raise ValueError("drafter_head_cut: only for a drafter given by name (cut a loaded one: head_cut.cut_head)")
    model, drafter_tok = model if isinstance(model, tuple) else (model, tokenizer)
    check_widths(target_model, model, tokenizer, drafter_tok)
    return drafter_part(drafter_for(model, config, len(drafter_tok)), tokenizer, drafter_tok, spec)
