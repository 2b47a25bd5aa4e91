"""`fly-serve generate "prompt"`: FLy on the embedded default pair (or any other pair), decoding
as the served default profile does unless a flag says otherwise; `fly-serve serve`: the Ray Serve
application on 127.0.0.1:8000; `fly-serve tune-k`: cost curves, acceptance and the best k per batch
size on this machine, written to k "auto"'s cost-profile cache (and printed as a
`speculation_profile` override)."""

import argparse
import json
import sys
import time
import typing
from dataclasses import asdict
from pathlib import Path

import yaml

from fly_bench import run as bench
from fly_cli import tune_k
from fly_cli.pair import add_pair
from fly_serve.engine.params import ParamError, Params, knobs


def _int_or_word(value: str):
    return int(value) if value.lstrip("-").isdigit() else value


def _base_type(annotation):
    """int for `int | None`, str for `list[str]`, int-or-word for `int | str` (k: 15 or "auto"),
    parsed JSON for `dict | None`: the type one flag value parses to."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return args[0]
    if set(args) == {int, str}:
        return _int_or_word
    if args == [dict]:  # response_format: JSON on the command line
        return json.loads
    return args[0] if args else annotation


# Params fields whose flag is the pair's (pair.py): `--drafter` names the one draft model here
PAIR_FLAGS = ("drafter",)
# The profile `fly-serve serve` runs by default: `generate` decodes as it does (one set of defaults)
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "deployments" / "profiles" / "cpu-default.yaml"
# The knobs the stats line reports beside the stats: what decided how the text was decoded
SHOWN_KNOBS = ("mode", "k", "k_max", "theta", "window", "temperature", "top_p", "seed", "max_tokens")


def served_defaults(profile: Path = DEFAULT_PROFILE) -> dict:
    """The engine defaults of a Serve profile's first application (its `args.defaults`)."""
    return dict(yaml.safe_load(profile.read_text())["applications"][0].get("args", {}).get("defaults", {}))


def add_knobs(p: argparse.ArgumentParser, defaults: dict) -> None:
    """One flag per Params field (params.py is the one list of knobs) but PAIR_FLAGS, unset unless
    given: the request is `defaults` (a profile's) with the given flags on top (params_from)."""
    shown = asdict(Params.from_dict(defaults))
    for f in knobs():
        if f.name in PAIR_FLAGS:
            continue
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        help = f"{meta['help']} (default: {shown[f.name]!r})"
        if f.type is bool:
            p.add_argument(f"--no-{f.name}", dest=f.name, action="store_const", const=False, help=f"off: {help}")
        elif isinstance(shown[f.name], list):
            p.add_argument(flag, dest=f.name, action="append", help=f"{help}, repeatable")
        else:
            p.add_argument(flag, dest=f.name, type=_base_type(f.type), choices=meta["choices"], help=help)


def params_from(args, defaults: dict) -> Params:
    """`defaults` with the flags given on top, as the server merges a request over its profile
    (Params.merged: a default window that does not fit the given k is dropped)."""
    flags = (f.name for f in knobs() if f.name not in PAIR_FLAGS)
    given = {name: getattr(args, name) for name in flags if getattr(args, name) is not None}
    return Params.from_dict(defaults).merged(given)


def generate(args) -> None:
    from fly_serve.build import build_engine
    from fly_serve.engine.prompts import chat_prompt

    def progress(msg):
        print(f"[fly-serve] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        params = params_from(args, served_defaults())
    except (ParamError, TypeError) as e:  # a knob's value refused: named
        sys.exit(f"error: {e}")
    try:
        engine = build_engine(
            args.target,
            args.drafter if params.mode_spec.source == "model" else None,
            dtype=args.dtype,
            drafter_precision=args.drafter_precision,
            drafter_head_cut=args.drafter_head_cut,
            max_batch=1,
            draft_min_confidence=args.draft_min_confidence,
            runtime=args.runtime,
            defaults=asdict(params),  # k "auto": the cost profile of this k_max (measured once, cached)
            calibrate=params.auto_k,
            progress=progress,
        )
    except ValueError as e:  # a knob the models refuse (--dtype fp32 on llama.cpp ...): named
        sys.exit(f"error: {e}")
    progress(f"models ready in {time.perf_counter() - t0:.1f} s; generating")
    try:
        prompt = args.prompt if args.raw else chat_prompt(engine.tokenizer, args.prompt)
        messages = None if args.raw else [{"role": "user", "content": args.prompt}]  # a drafter's own template
        req = engine.add(prompt, params, messages=messages)
    except ParamError as e:
        sys.exit(f"error: {e}")
    t0 = time.perf_counter()
    while not req.finished:
        engine.step()
        print(req.delta(), end="", flush=True)
    print(req.delta())
    wall = time.perf_counter() - t0
    stats = dict(
        req.stats.as_dict(),
        mode=params.mode,
        finish_reason=req.finish_reason,
        wall_s=round(wall, 3),
        tokens_per_s=round(req.stats.emitted / wall, 2),
        knobs=knobs_used(req.params, args, engine),
    )
    print(json.dumps(stats), file=sys.stderr)


def knobs_used(params: Params, args, engine) -> dict:
    """What decided how the text was decoded: the request's knobs (strict or loose), the window
    it ran with, and the runtime the target ran on."""
    used = {name: getattr(params, name) for name in SHOWN_KNOBS}
    used["window"] = params.effective_window
    used["loose"] = params.mode_spec.loose and params.theta < 1
    runner = getattr(engine.scorer, "runner", None)
    used["runtime"] = "llama.cpp" if type(runner).__name__ == "LlamaRunner" else "torch"
    used["dtype"] = args.dtype
    return used


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="fly-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate with the in-process engine")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    add_knobs(g, served_defaults())
    add_pair(g)
    sub.add_parser("serve", help="start the Ray Serve application (flags: fly-serve serve --help)", add_help=False)
    tune_k.add_args(sub.add_parser("tune-k", help="measure cost curves and acceptance; print the best k per batch"))
    bench.add_args(sub.add_parser("bench", help="speed and accuracy of every method and the peers on datasets"))
    args, rest = parser.parse_known_args(argv)
    if args.command in ("generate", "tune-k", "bench") and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "generate":
        generate(args)
    elif args.command == "tune-k":
        tune_k.run(args)
    elif args.command == "bench":
        bench.run(args)
    else:
        from deployments.launch import main as serve

        sys.exit(serve(rest))


if __name__ == "__main__":
    main()
