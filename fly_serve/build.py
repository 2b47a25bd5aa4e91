"""The one engine factory: a target and a drafter, by name or already loaded, in; an Engine out."""

from .cost_calibration import calibrate_engine, calibration_key, model_name
from .drafters import ModelDrafter
from .engine import Engine
from .head_cut import check_head_cut
from .loading import eos_ids, load_model, load_tokenizer
from .model_scorer import ModelScorer
from .params import Params
from .round_cost import CostProfile
from .weights import DEFAULT_DRAFTER, DEFAULT_TARGET, check_same_tokenizer


def check_widths(target_model, drafter_model, tokenizer) -> None:
    """Pairs may differ in logit width (Qwen2.5 0.5B: 151,936; 7B and larger: 152,064) as long as
    both cover every token the tokenizer can produce; both are cut to the tokenizer's tokens."""
    n = len(tokenizer)
    for role, model in (("target", target_model), ("drafter", drafter_model)):
        if model.config.vocab_size < n:
            raise ValueError(f"{role}: {model.config.vocab_size} logits cannot cover the tokenizer's {n} tokens")


def build_engine(
    target=DEFAULT_TARGET,
    drafter=DEFAULT_DRAFTER,
    *,
    tokenizer=None,
    dtype: str = "auto",
    drafter_precision: str = "int8",
    drafter_head_cut: int | None = None,
    max_batch: int = 8,
    max_model_len: int = 4096,
    defaults: Params | None = None,
    draft_min_confidence: float = 0.0,
    speculation_profile: CostProfile | dict | None = None,
    kv_budget_tokens: int | None = None,
    target_kv_budget_tokens: int | None = None,
    drafter_kv_budget_tokens: int | None = None,
    device=None,
    calibrate: bool | None = None,
    progress=print,
) -> Engine:
    """target / drafter: a model name (loading.py) or a loaded model; drafter None: no draft
    model (modes ar and pld). With a loaded target, pass its tokenizer. KV budgets, in tokens each
    cache holds (requests are admitted within the target's): target_kv_budget_tokens and
    drafter_kv_budget_tokens, each defaulting to kv_budget_tokens, which defaults to max_batch
    sequences of 4096 (a drafter's cache per token is far smaller than the target's, but on a small
    GPU beside a large drafter the two must be sized apart). device: where models given by name
    load (default: this process's, devices.local_device).
    drafter_head_cut: cut a drafter loaded by name to the lm_head rows of ids below it (head_cut.py);
    ignored without a drafter, refused with a loaded one (cut that with head_cut.cut_head).
    k "auto"'s cost profile: speculation_profile if given (an override), else measured here
    (cost_calibration.py; cached per machine, models and versions) when calibrate is True, or
    None and the defaults use k "auto"; otherwise the uncalibrated default shape, which the
    policy's cost check corrects from the first rounds (calibrate_engine can still be called)."""
    check_head_cut(drafter_head_cut, "drafter_head_cut")
    names = model_name(target), model_name(drafter)  # for the calibration's key, before loading
    if tokenizer is None:
        if not isinstance(target, str):
            raise ValueError("tokenizer: required when the target is an already-loaded model")
        tokenizer = load_tokenizer(target, progress)
    target_model = load_model(target, dtype, progress=progress, device=device) if isinstance(target, str) else target
    draft = None
    if drafter is not None:
        if isinstance(drafter, str):
            check_same_tokenizer(tokenizer, load_tokenizer(drafter, progress))
            drafter = load_model(
                drafter, drafter_precision, progress=progress, head_cut=drafter_head_cut, device=device
            )
        elif drafter_head_cut is not None:  # cutting a caller's model in place would surprise it
            raise ValueError("drafter_head_cut: only for a drafter given by name (cut a loaded one: head_cut.cut_head)")
        check_widths(target_model, drafter, tokenizer)
        draft = ModelDrafter(
            drafter,
            n_slots=max_batch,
            min_confidence=draft_min_confidence,
            vocab_size=len(tokenizer),
            kv_budget_tokens=drafter_kv_budget_tokens or kv_budget_tokens,
        )
    max_model_len = min(max_model_len, target_model.config.max_position_embeddings)
    target_budget = target_kv_budget_tokens or kv_budget_tokens
    scorer = ModelScorer(target_model, n_slots=max_batch, vocab_size=len(tokenizer), kv_budget_tokens=target_budget)
    engine = Engine(
        scorer,
        draft,
        tokenizer,
        eos_ids(target_model, tokenizer),
        max_batch=max_batch,
        max_model_len=max_model_len,
        defaults=defaults,
        speculation_profile=speculation_profile,
    )
    if speculation_profile is None and (engine.defaults.auto_k if calibrate is None else calibrate):
        key = calibration_key(
            *names,
            dtype=dtype,
            drafter_precision=drafter_precision,
            max_batch=max_batch,
            k_max=engine.defaults.k_max,
            drafter_head_cut=drafter_head_cut,
        )
        calibrate_engine(engine, key, progress=progress)
    return engine
