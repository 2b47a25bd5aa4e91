"""`fly-serve bench`: every method on the same pair, prompts and max_tokens, in one process; the
results go to <out>/results.jsonl (resumable), the figures to <out>/summary.{json,md} and PNGs.

Order of work: for each dataset, temperature, sample, batch size and chunk of `batch` problems,
every method runs the chunk before the next chunk starts, so methods share the machine's state
and a partial run still compares like with like.
"""

import argparse
import itertools
import os
import platform
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from fly_serve.config import DRAFTER_CPU_AUTO
from fly_serve.engine.params import MODES
from fly_serve.loading.loading import PRECISIONS, RUNTIMES

from . import choose, datasets, report
from .methods import Method, Output, Peer, ServerPeer, parse_method, run_engine
from .metrics import summarize
from .scoring import score
from .store import ResultStore

DEFAULT_METHODS = ("ar", "spd", "pld", "fly", "fly-nomla", "hf-greedy", "hf-assisted", "hf-pld")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", default=list(datasets.DATASETS), choices=datasets.DATASETS)
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        help="name or name:key=value,... (an ablation, e.g. fly:theta=0.6,window=4 or fly:rho=0.1); engine modes, "
        "fly-nomla, each also as name@torch or name@llama.cpp (a second engine on that runtime, e.g. ar@torch); "
        "hf-greedy, hf-assisted, hf-pld; llama-server, llama-server-draft, llama-server-ngram (keys: its flags, "
        "e.g. llama-server-draft:spec-draft-n-max=16)",
    )
    p.add_argument(
        "--sweep",
        nargs="+",
        default=[],
        metavar="KEY=V1,V2",
        help="add a fly method for every combination, e.g. --sweep theta=0.1,0.3,0.6 window=4,6 rho=0,0.1",
    )
    p.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[1, 8], help="engine and llama-server methods; hf peers run at 1"
    )
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--samples", type=int, default=3, help="samples per problem at T > 0 (seeded)")
    p.add_argument("--limit", type=int, default=10, help="problems per dataset")
    p.add_argument("--skip", type=int, default=0, help="skip the first N problems (keep calibration disjoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=None, help="drafts per round of engine methods (default: Params')")
    p.add_argument("--humaneval-raw", action="store_true", help="raw completion instead of the chat template")
    p.add_argument("--gsm-languages", nargs="+", default=list(datasets.DEFAULT_LANGUAGES))
    p.add_argument("--needle-tokens", type=int, default=2000, help="haystack length in tokens")
    p.add_argument("--needles", type=int, default=4, help="needle values per haystack")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HumanEval test run")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples of the recovery interval")
    p.add_argument("--out", default="bench_out", help="folder of results.jsonl, summary.json/.md, plots")
    p.add_argument("--report-only", action="store_true", help="no generation: figures from results.jsonl")
    p.add_argument(
        "--choose",
        action="store_true",
        help="calibration: name the fastest engine method whose recovery (datasets pooled) keeps the point "
        ">= 0.99 and the lower 95%% bound >= 0.97 (choose.py)",
    )
    p.add_argument("--target", default=None, help="model name (default: the embedded target)")
    p.add_argument("--drafter", default=None, help="model name (default: the embedded drafter)")
    p.add_argument(
        "--drafters",
        nargs="+",
        default=None,
        metavar="NAME[=MODEL]",
        help="several drafters in the engines (the first the default), each a known drafter's name (qwen-0.5b, "
        "gemma-270m) or NAME=MODEL; a method picks one with drafter=NAME (spd:drafter=gemma-270m,cross_vocab=tli), "
        "k auto chooses among them per row without one (fly:k=auto)",
    )
    p.add_argument("--dtype", default="auto", help="target precision (auto: bf16 where the hardware has it, else fp32)")
    p.add_argument(
        "--drafter-precision",
        default="auto",
        choices=PRECISIONS,
        help="auto: on llama.cpp the GGUF requantized to Q4_0 where faithful (fly_serve/loading/gguf_requant.py), "
        "int8 on torch on a CPU; shipped: the GGUF as is",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="threads of torch, llama.cpp and llama-server (default: torch's)"
    )
    p.add_argument(
        "--runtime",
        default="auto",
        choices=RUNTIMES,
        help="the default engine's model runtime (auto: llama.cpp's kernels for GGUF models on a CPU, else torch)",
    )


# ---- set-up
def sweep_methods(sweep: list[str]) -> list[str]:
    """--sweep theta=0.1,0.3 window=4,6 -> fly:theta=0.1,window=4 ... (every combination)."""
    axes = []
    for item in sweep:
        key, eq, values = item.partition("=")
        if not eq or not key or not values:
            raise ValueError(f"sweep: expected KEY=V1,V2,..., got {item!r}")
        axes.append([f"{key}={v}" for v in values.split(",")])
    return ["fly:" + ",".join(combo) for combo in itertools.product(*axes)] if axes else []


@dataclass
class Bench:
    """What one run holds: its engines (one per runtime, each built on first use), the peers on
    the same models (transformers' on the torch models, llama-server on the GGUF files), and what
    they need."""

    args: argparse.Namespace
    methods: list[Method]
    tokenizer: object
    target_name: str
    drafter_name: str
    runtime: str  # the default engine's: --runtime resolved (loading.resolve_runtime)
    drafters: dict | None  # --drafters: {name: model} (None: the one drafter, drafter_name)
    max_model_len: int  # the engines' context, and each llama-server slot's
    engines: dict[str, object] = field(default_factory=dict)  # by runtime
    torch_models: tuple | None = None  # (target, drafter or None) in torch, once loaded
    peer: Peer | None = None
    server: ServerPeer | None = None
    notes: list[str] = field(default_factory=list)
    hf_drafter_precision: str | None = None


def load_pair(args, methods: list[Method]) -> Bench:
    """The pair's names, tokenizer and context; models load when a method first needs them."""
    import torch

    from fly_serve.loading.loading import load_config, load_tokenizer, resolve_runtime
    from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

    if args.threads:
        torch.set_num_threads(args.threads)
    target_name, drafter_name = args.target or DEFAULT_TARGET, args.drafter or DEFAULT_DRAFTER
    tokenizer = load_tokenizer(target_name)
    max_model_len = min(4096, load_config(target_name).max_position_embeddings)  # as build_engine clamps it
    runtime = resolve_runtime(args.runtime, target_name, progress=_quiet)
    drafters = parse_drafters(args.drafters)
    if drafters:
        drafter_name = next(iter(drafters.values()))
    bench = Bench(args, methods, tokenizer, target_name, drafter_name, runtime, drafters, max_model_len)
    if any(m.kind == "llama-server" for m in methods):
        bench.server = server_peer(bench)
    return bench


def parse_drafters(items: list[str] | None) -> dict[str, str] | None:
    """--drafters NAME[=MODEL] ... -> {name: model} (a known drafter's name alone names its model)."""
    from fly_serve.loading.weights import drafter_model

    if not items:
        return None
    out = {}
    for item in items:
        name, eq, model = item.partition("=")
        if not name or (eq and not model):
            raise SystemExit(f"error: --drafters: expected NAME or NAME=MODEL, got {item!r}")
        out[name] = drafter_model(model if eq else name)
    return out


def server_peer(bench: Bench) -> ServerPeer:
    """llama-server on the GGUF files fly-serve's llama.cpp runtime reads for the same names, its
    threads the engines' (torch's setting, which LlamaRunner takes too)."""
    import torch

    from fly_serve.loading.loading import gguf_path

    from .llama_server import find_binary

    try:
        find_binary()
        target = gguf_path(bench.target_name, _quiet)
        draft = any(m.base == "llama-server-draft" for m in bench.methods)
        drafter = gguf_path(bench.drafter_name, _quiet) if draft else None
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"error: --methods llama-server*: {e}") from None
    return ServerPeer(target, drafter, torch.get_num_threads(), max(bench.args.batch_sizes), bench.max_model_len)


def runtime_of(bench: Bench, method: Method) -> str:
    """Where a method's rows ran: an engine's runtime, or the peer's own."""
    if method.kind == "hf":
        return "torch (transformers)"
    if method.kind == "llama-server":
        return "llama-server"
    return method.runtime or bench.runtime


def needs_drafter(bench: Bench, runtime: str) -> bool:
    """Whether the models on `runtime` need the drafter: an engine method there drafts with it,
    or (torch) transformers' assisted generation takes it as assistant."""
    engine = any(
        m.kind == "engine" and runtime_of(bench, m) == runtime and MODES[m.base].source == "model"
        for m in bench.methods
    )
    return engine or (runtime == "torch" and any(m.base == "hf-assisted" for m in bench.methods))


def torch_models(bench: Bench) -> tuple:
    """(target, drafter or None) loaded in torch, once: the torch engine's and the hf peers'."""
    from fly_serve.loading.loading import load_model

    if bench.torch_models is None:
        args = bench.args
        target = load_model(bench.target_name, args.dtype, progress=_quiet, runtime="torch")
        drafter = None
        if needs_drafter(bench, "torch"):
            drafter = load_model(
                bench.drafter_name,
                args.drafter_precision,
                progress=_quiet,
                runtime="torch",
                knob="drafter_precision",
                cpu_auto=DRAFTER_CPU_AUTO,
            )
        bench.torch_models = (target, drafter)
    return bench.torch_models


def engine_on(bench: Bench, runtime: str):
    """The engine of the pair on `runtime`, built on first use: on torch from the loaded models
    the hf peers share, on llama.cpp from the GGUF files by name (the target as shipped, the drafter at
    --drafter-precision: fly_serve/loading/gguf_requant.py)."""
    from fly_serve.build import build_engine

    if runtime not in bench.engines:
        if runtime == "torch":
            target, drafter = torch_models(bench)
        else:
            target = bench.target_name
            drafter = bench.drafter_name if needs_drafter(bench, runtime) else None
        if bench.drafters and needs_drafter(bench, runtime):
            drafter = dict(bench.drafters)  # every drafter by name, loaded on this runtime
        auto = any(m.kind == "engine" and m.options.get("k") == "auto" for m in bench.methods)
        bench.engines[runtime] = build_engine(
            target,
            drafter,
            tokenizer=bench.tokenizer,
            dtype=bench.args.dtype,
            drafter_precision=bench.args.drafter_precision,
            max_batch=max(bench.args.batch_sizes),
            max_model_len=bench.max_model_len,
            runtime=runtime,
            progress=_quiet,
            calibrate=auto,  # k auto's costs (each drafter's too) measured here, cached per machine
        )
    return bench.engines[runtime]


def hf_peer(bench: Bench) -> Peer:
    """transformers' generate on the pair loaded in torch (the torch engine's own models, if any)."""
    from fly_serve.loading.loading import eos_ids

    if bench.peer is None:
        target, drafter = torch_models(bench)
        bench.peer = Peer(target, drafter, bench.tokenizer, sorted(eos_ids(target, bench.tokenizer)))
    return bench.peer


def run_notes(bench: Bench) -> list[str]:
    """What the report says about where each row ran and how."""
    from fly_serve.loading.loading import gguf_path, resolve_precision

    args = bench.args
    notes = [f"pair: target {bench.target_name}, drafter {bench.drafter_name}; default engine runtime {bench.runtime}"]
    if bench.drafters:
        notes.append("drafters: " + ", ".join(f"{n} ({m})" for n, m in bench.drafters.items()))
    for runtime, engine in bench.engines.items():
        if line := drafter_costs(engine):
            notes.append(f"runtime {runtime}: {line}")
    by_runtime: dict[str, list[str]] = {}
    for m in bench.methods:
        by_runtime.setdefault(runtime_of(bench, m), []).append(m.label)
    for runtime, labels in by_runtime.items():
        notes.append(f"runtime {runtime}: {', '.join(labels)}")
    if bench.torch_models is not None:
        drafter = "no drafter" if bench.torch_models[1] is None else f"drafter {args.drafter_precision}"
        notes.append(
            f"torch models: target {resolve_precision(args.dtype)}, {drafter} "
            "(hf-* peers run on the same loaded models)"
        )
    if "llama.cpp" in bench.engines or bench.server:
        files = ", ".join(str(gguf_path(name, _quiet)) for name in (bench.target_name, bench.drafter_name))
        ours = bench.engines.get("llama.cpp")
        runs = getattr(getattr(getattr(ours, "drafters", {}).get("model"), "runner", None), "model", None)
        drafter = f"; the llama.cpp engine's drafter runs {runs.path}" if runs is not None else ""
        notes.append(
            f"llama-server: the GGUF files as shipped ({files}){drafter} (drafter_precision "
            f"{args.drafter_precision}: fly_serve/loading/gguf_requant.py); {_repack_note()}"
        )
    notes.append(
        "first divergence: the first token where an output parts from ar's (same dataset, T, batch, sample); "
        "bf16 verification can part outputs too (compare the spd row). First loose accept: the exact output "
        "position (0-based) of the first loosely accepted token that reached the output (the engine's "
        "first_loose_pos); ~ marks figures from older results that only knew the start of that round"
    )
    if bench.peer:
        notes.append(
            "hf-* peers: transformers' generate on the same loaded models, batch 1 (assisted generation "
            "and prompt lookup run one sequence at a time); speedup against ar at batch 1"
        )
    if bench.server and bench.server.servers:
        notes.append(
            f"llama-server peers ({_server_version(bench.server)}): the shipped GGUF files, prompts sent as token ids "
            "to /completion (streamed; greedy at T=0; no prompt cache, as the engines run without one); a batch "
            "of b is b requests at once to its slots (continuous batching); 'vs llama-server' is tok/s over "
            "llama-server's at the same dataset, T and batch. Commands: "
            + "; ".join(f"{label}: `{cmd}`" for label, cmd in bench.server.commands().items())
        )
    return notes + bench.notes


def drafter_costs(engine) -> str | None:
    """Each model drafter's seconds per forward of one row against one one-token target forward,
    as k auto's calibration measured them here (None: not calibrated)."""
    profile = engine.policy.profile
    if profile.source != "measured" or not engine.drafter_names:
        return None
    step = engine.policy.cost.verify_s(1)
    costs = []
    for name in engine.drafter_names:
        p = profile.for_drafter(name) if name != engine.default_drafter else profile
        per = p.draft_per_forward + p.draft_per_row_forward
        costs.append(f"{name} {per * 1e3:.1f} ms = {per / step:.2f}x")
    return f"drafter forward (1 row) against a target step ({step * 1e3:.1f} ms), calibrated: " + ", ".join(costs)


def _repack_note() -> str:
    from .llama_server import repack_allowed

    if repack_allowed():
        return "weights repacked for llama.cpp's CPU kernels"
    return "no repacking (llama.cpp's AMX kernels crash here: llama_runner.amx_kernels_unsafe), llama-server too"


def _server_version(peer: ServerPeer) -> str:
    return next(iter(peer.servers.values())).version()


def _quiet(message: str) -> None:
    pass


def prompt_ids(tokenizer, problem: datasets.Problem) -> list[int]:
    from fly_serve.engine.prompts import chat_prompt, encode

    return encode(tokenizer, problem.text) if problem.raw else chat_prompt(tokenizer, problem.text)


def sample_seed(seed: int, problem: str, sample: int) -> int:
    """A per-sample seed, the same for every method (paired samples at T > 0)."""
    return zlib.crc32(f"{seed}:{problem}:{sample}".encode())


def load_problems(args, count_tokens) -> dict[str, list[datasets.Problem]]:
    options = dict(
        humaneval_raw=args.humaneval_raw,
        gsm_languages=args.gsm_languages,
        seed=args.seed,
        needle_tokens=args.needle_tokens,
        needles=args.needles,
        count_tokens=count_tokens,
    )
    found = {}
    for name in args.datasets:
        try:
            found[name] = datasets.load(name, args.limit, args.skip, options)
        except datasets.DatasetMissing as e:
            print(f"[bench] skipping {name}: {e}", file=sys.stderr)
    return found


# ---- the work
def run_peer(bench: Bench, method: Method, prompts, settings) -> list[Output]:
    """A peer's samples one at a time. If transformers refuses the int8 drafter as assistant, the
    drafter is loaded again in bf16 for the peer, and the report says so."""
    outs = []
    peer = hf_peer(bench)
    for prompt, setting in zip(prompts, settings):
        try:
            outs.append(peer.generate(method, prompt, setting))
        except Exception as e:
            if method.base != "hf-assisted" or bench.hf_drafter_precision is not None:
                raise
            peer.drafter = reload_drafter_bf16(bench, e)
            outs.append(peer.generate(method, prompt, setting))
        if method.base == "hf-assisted" and bench.hf_drafter_precision is None:
            bench.hf_drafter_precision = "same as the engine's"
            bench.notes.append("hf-assisted: assistant_model = the engine's own drafter object (same precision)")
    return outs


def reload_drafter_bf16(bench: Bench, error: Exception):
    from fly_serve.loading.loading import load_model

    bench.hf_drafter_precision = "bf16"
    bench.notes.append(
        f"hf-assisted: transformers refused the int8 drafter ({type(error).__name__}: {error}); "
        "its assistant is the same drafter in bf16"
    )
    return load_model(bench.drafter_name, "bf16")


def run_chunk(bench: Bench, method: Method, problems, prompts, settings) -> list[Output]:
    if method.kind == "hf":
        return run_peer(bench, method, prompts, settings)
    if method.kind == "llama-server":
        return bench.server.generate(method, prompts, settings)
    return run_engine(engine_on(bench, runtime_of(bench, method)), method, prompts, settings)


def record(problem, method, batch, temperature, sample, out: Output, value: float, runtime: str) -> dict:
    peer = {} if out.timings is None else dict(ttft_s=out.ttft_s, timings=out.timings)
    return dict(
        dataset=problem.dataset,
        problem=problem.pid,
        method=method.label,
        batch=batch,
        temperature=temperature,
        sample=sample,
        score=value,
        runtime=runtime,
        tokens=len(out.token_ids),
        wall_s=round(out.wall_s, 4),
        rounds=out.rounds,
        drafted=out.drafted,
        accepted=out.accepted,
        loosely=out.loosely,
        finish_reason=out.finish_reason,
        first_loose_pos=out.first_loose_pos,
        token_ids=out.token_ids,
        text=out.text,
        **peer,
        **problem.meta,
    )


def work_units(args, problems: dict, methods: list[Method]):
    """(dataset, temperature, sample, batch, chunk of problems, method), in the order they run."""
    for name, probs in problems.items():
        for temperature in args.temperatures:
            for sample in range(args.samples if temperature > 0 else 1):
                for batch in args.batch_sizes:
                    for i in range(0, len(probs), batch):
                        for method in methods:
                            if method.batch_sizes_allowed is None or batch in method.batch_sizes_allowed:
                                yield name, temperature, sample, batch, probs[i : i + batch], method


def warm_up(bench: Bench, methods: list[Method]) -> None:
    """One short generation per method, untimed: first-call costs stay out of the figures."""
    prompt = prompt_ids(bench.tokenizer, datasets.Problem("warmup", "0", "Write a haiku about the sea.", None))
    for method in methods:
        run_chunk(bench, method, None, [prompt], [dict(max_tokens=8, temperature=0.0, seed=0, stop=[])])


def generate_all(args, bench: Bench, problems: dict, methods: list[Method], store: ResultStore) -> None:
    from tqdm import tqdm

    ids = {p.pid: prompt_ids(bench.tokenizer, p) for probs in problems.values() for p in probs}
    units = list(work_units(args, problems, methods))
    todo = [u for u in units if any(not store.done(key(p, u)) for p in u[4])]
    print(f"[bench] {len(units) - len(todo)} of {len(units)} chunks already in {store.path}", file=sys.stderr)
    if not todo:
        return
    warm_up(bench, methods)
    for unit in tqdm(todo, desc="bench", unit="chunk"):
        name, temperature, sample, batch, chunk, method = unit
        pending = [p for p in chunk if not store.done(key(p, unit))]
        settings = [
            dict(
                max_tokens=args.max_tokens,
                temperature=temperature,
                seed=sample_seed(args.seed, p.pid, sample),
                stop=list(p.stop),
            )
            for p in pending
        ]
        outs = run_chunk(bench, method, pending, [ids[p.pid] for p in pending], settings)
        runtime = runtime_of(bench, method)
        for p, out in zip(pending, outs):
            store.add(record(p, method, batch, temperature, sample, out, score(p, out.text, args.timeout), runtime))


def key(problem, unit) -> tuple:
    name, temperature, sample, batch, _, method = unit
    return (problem.dataset, problem.pid, method.label, batch, temperature, sample)


def check_fits(bench: Bench, problems: dict, max_tokens: int) -> None:
    """A prompt + max_tokens past the context would fail mid-run: refuse before any work."""
    limit = bench.max_model_len
    for probs in problems.values():
        for p in probs:
            n = len(prompt_ids(bench.tokenizer, p))
            if n + max_tokens > limit:
                raise ValueError(
                    f"max_tokens: {p.pid} has {n} prompt tokens; + {max_tokens} exceeds the context of {limit} "
                    "(lower --max-tokens or --needle-tokens)"
                )


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"


def run(args, problems: dict[str, list[datasets.Problem]] | None = None) -> list:
    """The whole bench; returns the summary rows. problems: {dataset: [Problem]} instead of the
    datasets' packages (a small built-in sample in tests)."""
    for name, value in (("limit", args.limit), ("samples", args.samples), ("max_tokens", args.max_tokens)):
        if value < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}: must be >= 1 (got {value})")
    if any(b < 1 for b in args.batch_sizes):
        raise SystemExit("error: --batch-sizes: must be >= 1")
    try:
        methods = [parse_method(m) for m in dict.fromkeys([*args.methods, *sweep_methods(args.sweep)])]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.k is not None:
        methods = [
            replace(m, options={"k": args.k, **m.options}) if m.kind == "engine" and m.base != "ar" else m
            for m in methods
        ]
    out_dir = Path(args.out)
    store = ResultStore(out_dir / "results.jsonl")
    notes = []
    if not args.report_only:
        t0 = time.perf_counter()
        bench = load_pair(args, methods)
        if problems is None:
            problems = load_problems(args, lambda text: len(bench.tokenizer.encode(text, add_special_tokens=False)))
        if not problems:
            raise SystemExit("error: --datasets: none of the datasets is installed (see the messages above)")
        check_fits(bench, problems, args.max_tokens)
        print(f"[bench] pair and data ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        try:
            generate_all(args, bench, problems, methods, store)
            notes = run_notes(bench)
        finally:
            if bench.server:
                bench.server.close()
    # the figures of this command's datasets and methods (one --out may hold more)
    labels = {m.label for m in methods}
    records = [r for r in store.all() if r["method"] in labels and r["dataset"] in args.datasets]
    rows = summarize(records, n_boot=args.bootstrap, seed=args.seed)
    config = dict(vars(args), machine=machine(), methods=[m.label for m in methods])
    choices = []
    if args.choose:
        engine = {m.label for m in methods if m.kind == "engine"}
        choices = choose.choose(records, engine, n_boot=args.bootstrap, seed=args.seed)
    paths = report.write(rows, out_dir, config, notes, choices)
    print(report.markdown(rows, notes, choices))
    print("[bench] wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="fly-serve bench", description=__doc__)
    add_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
