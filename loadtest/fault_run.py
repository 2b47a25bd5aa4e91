"""One fault run against a live `fly-serve serve` that this run starts (127.0.0.1 only) and stops,
even on error: the scenarios of scenarios.py and fuzz.py in sequence, their results printed.

  a. the drafter replica SIGKILLed mid-generation (2 plain + 1 streaming requests in flight):
     how each in-flight request ended, seconds until a new drafter replica drafts with the model;
  b. one TP rank SIGKILLed mid-generation: how each in-flight request ended, seconds until
     /healthz says 503 (if it does) and until a request succeeds again;
  c. overload: 4 x max_batch + max_waiting concurrent short requests: 200 / 503 / other / hung;
  d. schemathesis against the app's own OpenAPI schema, 1,000 fresh cases per route by default
     (a new seed each run, printed): status codes, and every 5xx;
  e. (--soak N) soak.py's long run of N requests: outcomes, RSS at its start and end.

    python -m loadtest.fault_run                       # cpu-tp2 (TP group + drafter replica), real pair
    python -m loadtest.fault_run --tiny --fuzz-cases 100   # tiny random models: a check in minutes
    python -m loadtest.fault_run --soak 500 --port 8011

Prints ONE JSON summary and a markdown table on stdout (progress goes to stderr). Every wait has
a timeout; a request with no answer within --timeout-s counts as hung. Only processes this run
started are killed (procs.kill_ours checks that they descend from it).
"""

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from . import fuzz, soak
from .procs import alive, descendants
from .scenarios import App, drafter_kill, overload, tp_rank_kill
from .server import ROOT, ServeProcess, profile_path
from .waits import wait_healthy


def log(msg: str) -> None:
    print(f"[fault_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def soak_run(app: App, args) -> dict:
    argv = ["--url", app.url, "--requests", str(args.soak), "--concurrency", str(args.soak_concurrency)]
    argv += ["--max-tokens", str(args.max_tokens), "--timeout-s", str(app.timeout_s), "--server-pid", str(app.root_pid)]
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only this run's summary
        return soak.main(argv)


def fuzz_run(app: App, args) -> dict:
    run = fuzz.fuzz_app(app.url, args.fuzz_cases, args.fuzz_max_tokens, app.timeout_s, args.fuzz_seed)
    return run.summary()


def phases(app: App, args, prof: dict) -> list[tuple[str, Callable[[], dict]]]:
    out = [
        ("drafter_kill", lambda: drafter_kill(app, args.inflight_tokens, args.max_tokens).summary()),
        ("tp_rank_kill", lambda: tp_rank_kill(app, args.inflight_tokens, args.max_tokens).summary()),
        (
            "overload",
            lambda: overload(
                app, int(prof.get("max_batch", 8)), int(prof.get("max_waiting", 16)), args.max_tokens
            ).summary(),
        ),
        ("schemathesis", lambda: fuzz_run(app, args)),
    ]
    if args.soak:
        out.append(("soak", lambda: soak_run(app, args)))
    return out


def run_phases(app: App, args, prof: dict) -> dict:
    """Each phase in turn, each after the app is healthy and idle again; a phase that raises is
    recorded and the next runs; a phase the app is not healthy for is skipped."""
    out: dict[str, dict] = {}
    for name, phase in phases(app, args, prof):
        if not wait_healthy(app.url, app.recovery_timeout_s):
            out[name] = {"skipped": f"the app was not healthy and idle within {app.recovery_timeout_s:g} s"}
            log(f"{name}: skipped (not healthy)")
            continue
        log(f"{name} ...")
        t0 = time.monotonic()
        try:
            out[name] = phase()
        except Exception as e:
            out[name] = {"error": repr(e)[:500]}
        out[name]["phase_s"] = round(time.monotonic() - t0, 1)
        log(f"{name}: done in {out[name]['phase_s']} s")
    return out


def app_args(path: Path) -> dict:
    """The first application's args in a Serve config (the profile's max_batch, max_waiting)."""
    return yaml.safe_load(path.read_text())["applications"][0].get("args", {})


# ---- output
def _cells(t: dict) -> list:
    return [t.get(k, "") for k in ("sent", "answered", "errored", "dropped", "hung")]


def table(summary: dict) -> str:
    """The markdown table of the run: one row per fault (and the requests after it)."""
    rows = [["fault", "sent", "answered", "errored", "dropped", "hung", "recovery / notes"]]
    d, tp, ov = summary.get("drafter_kill", {}), summary.get("tp_rank_kill", {}), summary.get("overload", {})
    fz, sk = summary.get("schemathesis", {}), summary.get("soak")
    if "in_flight" in d:
        back = "no new replica drafted" if d["recovery_s"] is None else f"drafting again after {d['recovery_s']} s"
        note = f"{back} (pid {d['drafter_pid']})"
        rows.append(["drafter replica SIGKILL: in flight (2 plain, 1 stream)", *_cells(d["in_flight"]), note])
        note = f"drafted {d['later_drafted']}"
        rows.append(["drafter replica SIGKILL: later requests", *_cells(d["later_requests"]), note])
    if "in_flight" in tp:
        went, back = tp["healthz_503_s"], tp["healthz_200_again_s"]
        health = "/healthz never 503" if went is None else f"/healthz 503 after {went} s (200 again after {back} s)"
        first = tp["first_success_s"]
        note = f"{health}; " + ("no success" if first is None else f"first success {first} s after the kill")
        rows.append(["TP rank SIGKILL: in flight (2 plain, 1 stream)", *_cells(tp["in_flight"]), note])
        note = f"until the first success: {tp['requests_until_success']}"
        rows.append(["TP rank SIGKILL: later requests", *_cells(tp["later_requests"]), note])
    if "counts" in ov:
        c = ov["counts"]
        note = f"503: {c['503']} {ov['503_error_codes']}, slowest {ov['max_s']['503']} s; other: {c['other']}"
        row = [f"overload ({ov['concurrent']} concurrent)", ov["concurrent"], c["200"], c["503"] + c["other"], 0]
        rows.append([*row, c["hung"], note])
    if "cases_per_route" in fz:
        statuses: dict[str, int] = {}
        for per_op in fz["statuses"].values():
            for k, v in per_op.items():
                statuses[k] = statuses.get(k, 0) + v
        fives = sum(v for k, v in statuses.items() if k.startswith("5"))
        ok = sum(v for k, v in statuses.items() if k.startswith("2"))
        note = f"seed {fz['seed']}; cases per route {fz['cases_per_route']}; statuses {statuses}; 5xx: {fives}"
        rows.append(["schemathesis", sum(fz["cases_per_route"].values()), ok, sum(statuses.values()) - ok, "", ""])
        rows[-1].append(note)
    if sk and "outcomes" in sk:
        o = sk["outcomes"]
        start, end = sum(sk["rss_mib_start"].values()), sum(sk["rss_mib_end"].values())
        errored = o.get("rejected", 0) + o.get("shed", 0) + o.get("unexpected", 0)
        note = f"{o}; RSS of the app's processes {start:.0f} -> {end:.0f} MiB"
        rows.append([f"soak ({sk['requests']} requests)", sk["requests"], o.get("answered", 0), errored])
        rows[-1] += [o.get("client_left", 0), o.get("hung", 0), note]
    for name in ("drafter_kill", "tp_rank_kill", "overload", "schemathesis", "soak"):
        part = summary.get(name) or {}
        if "error" in part or "skipped" in part:
            rows.append([name, "", "", "", "", "", part.get("error") or part.get("skipped")])
    lines = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # cpu-tp2: the CPU profile with a TP group and a drafter replica, so that both kills have a target
    p.add_argument("--profile", default="cpu-tp2", help="a name in deployments/ or a Serve config YAML")
    p.add_argument("--tiny", action="store_true", help="tiny random models (a fast check of the run itself)")
    p.add_argument("--port", type=int, default=0, help="the server's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the server's Ray")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens of the short requests")
    p.add_argument("--inflight-tokens", type=int, default=None, help="tokens of in-flight requests (64; tiny 400)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request with no answer by then is hung")
    p.add_argument("--start-timeout-s", type=float, default=1800.0, help="until the server says it is ready")
    p.add_argument("--recovery-timeout-s", type=float, default=600.0)
    p.add_argument("--fuzz-cases", type=int, default=1000, help="schemathesis cases per route (half valid)")
    p.add_argument("--fuzz-seed", type=int, default=None, help="replay a run's cases (default: a fresh seed)")
    p.add_argument("--fuzz-max-tokens", type=int, default=fuzz.MAX_TOKENS)
    p.add_argument("--soak", type=int, default=0, metavar="N", help="then soak.py's run of N requests")
    p.add_argument("--soak-concurrency", type=int, default=8)
    p.add_argument("--grace-s", type=float, default=30.0, help="the server's grace period when this run stops it")
    p.add_argument("--server-log", default=None, help="write the server's output here")
    args = p.parse_args(argv)
    if args.inflight_tokens is None:
        args.inflight_tokens = 400 if args.tiny else 64
    if not profile_path(args.profile).is_file():
        p.error(f"--profile: no such config {profile_path(args.profile)}")
    return args


def stop(server: ServeProcess, args) -> dict:
    """SIGTERM, then the process group; which of the server's processes outlived it."""
    before = descendants(server.pid)
    t0 = time.monotonic()
    rc = server.stop(timeout_s=args.grace_s + 90)
    time.sleep(2)  # Ray workers end when their raylet does
    left = [p for p in before if alive(p)]
    log(f"server stopped (exit {rc}) in {time.monotonic() - t0:.1f} s; of its {len(before)} processes left: {left}")
    if args.server_log:
        Path(args.server_log).write_text("\n".join(server.lines) + "\n")
    return {"exit_code": rc, "stop_s": round(time.monotonic() - t0, 1), "processes_left": left}


def main(argv=None) -> dict:
    args = parse(argv)
    # a SIGTERM to this run ends it through `finally`, which stops the server it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    config = profile_path(args.profile)
    t0 = time.monotonic()
    server = ServeProcess(args.port, tiny=args.tiny, config=str(config), grace_s=args.grace_s, num_cpus=args.num_cpus)
    log(f"started `fly-serve serve` (pid {server.pid}) on {server.url}; waiting until ready")
    summary: dict = {
        "profile": str(config.resolve().relative_to(ROOT)) if config.resolve().is_relative_to(ROOT) else str(config),
        "tiny": args.tiny,
        "url": server.url,
        "max_tokens": args.max_tokens,
        "inflight_tokens": args.inflight_tokens,
        "timeout_s": args.timeout_s,
    }
    try:
        if not server.wait_for("fly-serve: ready", args.start_timeout_s):
            log("the server did not become ready; its last lines:\n" + "\n".join(server.lines[-40:]))
            raise SystemExit(1)
        summary["start_s"] = round(time.monotonic() - t0, 1)
        app = App(server.url, server.pid, args.timeout_s, args.recovery_timeout_s)
        summary |= run_phases(app, args, app_args(config))
    finally:
        summary["server_stop"] = stop(server, args)
    print(json.dumps(summary, indent=1))
    print()
    print(table(summary))
    return summary


if __name__ == "__main__":
    main()
