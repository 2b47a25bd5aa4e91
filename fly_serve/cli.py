"""`fly-serve generate "prompt"`: FLy on the embedded default pair (or any other pair);
`fly-serve serve`: the Ray Serve application on 127.0.0.1:8000."""
import argparse
import json
import sys
import time

from .params import MODES, Params
from .verify import ENTROPIES, WINDOW_RULES


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def add_knobs(p: argparse.ArgumentParser):
    d = Params()
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--k", type=int, default=d.k, help="drafts per round")
    p.add_argument("--theta", type=float, default=d.theta, help="entropy gate (>= 1: strict SPD)")
    p.add_argument("--window", type=int, default=d.window, help="deferred window W")
    p.add_argument("--entropy", choices=ENTROPIES, default=d.entropy)
    p.add_argument("--window-rule", choices=WINDOW_RULES, default=d.window_rule)
    p.add_argument("--no-mla", dest="mla", action="store_false", help="draft one token per drafter forward")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)


def add_pair(p: argparse.ArgumentParser):
    from .pair import DRAFTER_PRECISIONS, DTYPES
    from .weights import DEFAULT_DRAFTER, DEFAULT_TARGET
    p.add_argument("--target", default=DEFAULT_TARGET, help="HF model id or local directory")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="HF model id or local directory")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="target precision")
    p.add_argument("--drafter-precision", choices=DRAFTER_PRECISIONS, default="int8")
    p.add_argument("--draft-min-confidence", type=float, default=0.0,
                   help="stop drafting a row once the drafter's probability of its token is below this")


def params_from(args) -> Params:
    return Params(mode=args.mode, k=args.k, theta=args.theta, window=args.window, entropy=args.entropy,
                  window_rule=args.window_rule, mla=args.mla, temperature=args.temperature, top_p=args.top_p,
                  max_tokens=args.max_tokens, stop=args.stop, seed=args.seed)


def generate(args):
    from .pair import build_engine
    progress = lambda msg: print(f"[fly-serve] {msg}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    needs_drafter = args.mode in ("spd", "fly")
    engine = build_engine(args.target, args.drafter if needs_drafter else None, args.dtype,
                          args.drafter_precision, max_batch=1, draft_min_confidence=args.draft_min_confidence,
                          progress=progress)
    progress(f"models ready in {time.perf_counter() - t0:.1f} s; generating")
    prompt = args.prompt if args.raw else chat_prompt(engine.tokenizer, args.prompt)
    try:
        req = engine.add(prompt, params_from(args))
    except ValueError as e:
        sys.exit(f"error: {e}")
    t0 = time.perf_counter()
    while not req.finished:
        engine.step()
        print(req.delta(), end="", flush=True)
    print(req.delta())
    wall = time.perf_counter() - t0
    stats = dict(req.stats.as_dict(), mode=args.mode, finish_reason=req.finish_reason,
                 wall_s=round(wall, 3), tokens_per_s=round(req.stats.emitted / wall, 2))
    print(json.dumps(stats), file=sys.stderr)


def serve(args, rest):
    from deployments.launch import main
    main(rest)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fly-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate with the in-process engine")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    add_knobs(g)
    add_pair(g)
    sub.add_parser("serve", help="start the Ray Serve application (flags: fly-serve serve --help)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "generate":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        generate(args)
    else:
        serve(args, rest)


if __name__ == "__main__":
    main()
