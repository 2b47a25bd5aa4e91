"""One fault run against a live `fly-serve serve` that this script starts (127.0.0.1 only) and stops,
even on error: in sequence

  a. the drafter replica SIGKILLed mid-generation (2 plain + 1 streaming requests in flight):
     how each in-flight request ended, seconds until a new drafter replica drafts with the model;
  b. one TP rank SIGKILLed mid-generation: how each in-flight request ended, seconds until
     /healthz says 503 (if it does) and until a request succeeds again;
  c. overload: 4 x max_batch + max_waiting concurrent short requests: 200 / 503 / other / hung;
  d. schemathesis against the app's own OpenAPI schema: cases per operation, status codes;
  e. (--soak N) loadtest/soak.py's long run of N requests: outcomes, RSS at its start and end.

    python loadtest/fault_run.py                       # the default profile (cpu-default), real pair
    python loadtest/fault_run.py --tiny                # tiny random models: a check in minutes
    python loadtest/fault_run.py --soak 500 --port 8011

Prints ONE JSON summary and a markdown table on stdout (progress goes to stderr). Every wait has
a timeout; a request with no answer within --timeout-s counts as hung. Only processes this run
started are killed (faults.kill_ours checks that they descend from it).
"""

import argparse
import contextlib
import json
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import faults
import psutil
import soak
import yaml

PROMPT = "def add(a, b):\n    return"
PROFILES = faults.ROOT / "deployments"
N_LATER = 3  # requests after a recovery, to show it holds


@dataclass
class Run:
    """What every phase needs: the server and the run's limits."""

    server: faults.ServeProcess
    max_tokens: int  # short requests (probes, overload)
    inflight_tokens: int  # requests in flight when a fault comes
    timeout_s: float  # a request with no answer by then is hung
    recovery_timeout_s: float
    max_batch: int
    max_waiting: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.proc.pid


def log(msg: str) -> None:
    print(f"[fault_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- helpers
def ended_after(outcomes: list[faults.Outcome], t: float) -> list[float]:
    return [round(o.ended - t, 1) for o in outcomes]


def what_failed(o: faults.Outcome) -> str:
    """How a request failed, without what differs per request (its id): comparable across requests."""
    err = (o.body or {}).get("error") if o.kind == "error" else None
    if not isinstance(err, dict):
        return f"{o.kind}: {o.detail[:160]}"
    message = re.sub(r"request id \S+", "request id <id>", str(err.get("message")))[:160]
    return f"{o.status} {err.get('type')}/{err.get('code')}: {message}"


def distinct_errors(outcomes: list[faults.Outcome]) -> dict[str, int]:
    """Each way the failed requests failed, and how many failed that way."""
    out: dict[str, int] = {}
    for o in outcomes:
        if o.kind != "ok":
            out[what_failed(o)] = out.get(what_failed(o), 0) + 1
    return out


def probe_until(
    run: Run, body: dict, since: float, done: Callable[[list[faults.Outcome]], bool]
) -> list[faults.Outcome]:
    """Short requests, one after another, until `done(the requests so far)` or the recovery
    timeout from `since` has passed."""
    probes: list[faults.Outcome] = []
    while time.monotonic() - since < run.recovery_timeout_s and not done(probes):
        probes.append(faults.complete(run.url, body, timeout_s=run.timeout_s))
        if not done(probes):
            time.sleep(0.5)
    return probes


def drafter_cache(url: str) -> dict | None:
    """The drafter's cache report through the ingress; None while no replica answers."""
    try:
        return faults.stats(url, timeout_s=10).get("drafter_cache")
    except Exception:
        return None


def newest(pids: list[int]) -> int | None:
    return pids[-1] if pids else None


# ---- a. drafter replica SIGKILL
def drafter_fault(run: Run) -> dict:
    old = faults.actor_pids(run.pid, "FlyDrafter")
    if len(old) != 1:
        return {"error": f"expected one drafter replica, found pids {old}"}
    old_pid = old[0]
    # small k and window: each request takes many rounds, so it is still running when the kill comes
    body = {"prompt": PROMPT, "max_tokens": run.inflight_tokens, "fly": {"mode": "fly", "k": 2, "window": 1}}
    pool, futures = faults.in_flight(run.url, body, timeout_s=run.timeout_s)
    faults.wait_generating(run.url, len(futures), timeout_s=run.timeout_s, rounds=2)
    t_kill = time.monotonic()
    faults.kill_ours(old_pid)
    log(f"drafter replica {old_pid} SIGKILLed with {len(futures)} in flight")
    watch = faults.DrafterWatch(
        old_pid, lambda: newest(faults.actor_pids(run.pid, "FlyDrafter")), lambda: drafter_cache(run.url), poll_s=0.5
    )
    try:
        outcomes = faults.gather(pool, futures, run.timeout_s + 30)
        # the in-flight requests may end before the new replica is up: later ones give it rounds
        probe = {"prompt": PROMPT, "max_tokens": run.max_tokens, "fly": {"mode": "fly"}}
        waiting = probe_until(run, probe, t_kill, lambda _: watch.back_at is not None)
    finally:
        watch.close()
    later = [faults.complete(run.url, probe, timeout_s=run.timeout_s) for _ in range(N_LATER)]
    return {
        "in_flight": faults.tally(outcomes),
        "in_flight_ended_before_kill": sum(o.ended <= t_kill for o in outcomes),
        "in_flight_ended_s_after_kill": ended_after(outcomes, t_kill),
        "in_flight_finished_normally": sum(o.kind == "ok" and faults.finished_normally(o) for o in outcomes),
        "in_flight_errors": distinct_errors(outcomes),
        "stream_longest_pause_s": round(outcomes[-1].longest_pause_s, 1),
        "recovery_s": None if watch.back_at is None else round(watch.back_at - t_kill, 1),
        "drafter_pid": f"{old_pid} -> {watch.new_pid}",
        "old_pid_alive": faults.alive(old_pid),
        "requests_while_recovering": faults.tally(waiting),
        "errors_while_recovering": distinct_errors(waiting),
        "later_requests": faults.tally(later),
        "later_errors": distinct_errors(later),
        "later_drafted": [p.body["fly"]["drafted"] for p in later if p.kind == "ok"],
        "new_drafter_cache": drafter_cache(run.url),
    }


# ---- b. one TP rank SIGKILL
def tp_fault(run: Run) -> dict:
    old_ranks = faults.actor_pids(run.pid, "TPWorker")
    if len(old_ranks) < 2:
        return {"error": f"expected TP ranks (tp_size > 1), found pids {old_ranks}"}
    victim = old_ranks[-1]
    body = {"prompt": PROMPT, "max_tokens": run.inflight_tokens, "fly": {"mode": "ar"}}
    pool, futures = faults.in_flight(run.url, body, timeout_s=run.timeout_s)
    faults.wait_generating(run.url, len(futures), timeout_s=run.timeout_s, rounds=2)
    health = faults.HealthWatch(run.url)
    t_kill = health.t0
    faults.kill_ours(victim)
    log(f"TP rank {victim} (of {old_ranks}) SIGKILLed with {len(futures)} in flight")
    try:
        outcomes = faults.gather(pool, futures, run.timeout_s + 30)
        probe = {"prompt": PROMPT, "max_tokens": run.max_tokens, "fly": {"mode": "ar"}}
        probes = probe_until(run, probe, t_kill, lambda ps: bool(ps) and ps[-1].kind == "ok")
    finally:
        health.close()
    first_ok = next((p for p in probes if p.kind == "ok"), None)
    later = [faults.complete(run.url, probe, timeout_s=run.timeout_s) for _ in range(N_LATER)] if first_ok else []
    went_503 = health.first(503)
    return {
        "killed_rank_pid": victim,
        "in_flight": faults.tally(outcomes),
        "in_flight_ended_before_kill": sum(o.ended <= t_kill for o in outcomes),
        "in_flight_ended_s_after_kill": ended_after(outcomes, t_kill),
        "in_flight_errors": distinct_errors(outcomes),
        "healthz_503_s": went_503,
        "healthz_200_again_s": None if went_503 is None else health.first(200, after_s=went_503),
        "healthz_changes": [[round(t, 1), s] for t, s in health.changes],
        "first_success_s": None if first_ok is None else round(first_ok.ended - t_kill, 1),
        "requests_until_success": faults.tally(probes),
        "errors_until_success": distinct_errors(probes),
        "later_requests": faults.tally(later),
        "later_errors": distinct_errors(later),
        "rank_pids": f"{old_ranks} -> {faults.actor_pids(run.pid, 'TPWorker')}",
        "old_ranks_alive": [p for p in old_ranks if faults.alive(p)],
    }


# ---- c. overload
def overload(run: Run) -> dict:
    n = 4 * run.max_batch + run.max_waiting
    body = {"prompt": PROMPT, "max_tokens": run.max_tokens}
    pool, futures = faults.in_flight(run.url, body, n_plain=n, n_stream=0, timeout_s=run.timeout_s)
    t0 = time.monotonic()
    outcomes = faults.gather(pool, futures, run.timeout_s + 30)
    counts = {"200": 0, "503": 0, "other": 0, "hung": 0}
    codes: dict[str, int] = {}
    for o in outcomes:
        key = "hung" if o.kind == "hung" else "200" if o.kind == "ok" else "503" if o.status == 503 else "other"
        counts[key] += 1
        if key == "503":
            code = str(((o.body or {}).get("error") or {}).get("code"))
            codes[code] = codes.get(code, 0) + 1
    seconds = {k: [o.ended - o.started for o in outcomes if o.status == s] for k, s in (("200", 200), ("503", 503))}
    return {
        "concurrent": n,
        "max_batch": run.max_batch,
        "max_waiting": run.max_waiting,
        "counts": counts,
        "503_error_codes": codes,
        "max_s": {k: round(max(v), 2) if v else None for k, v in seconds.items()},
        "other": distinct_errors([o for o in outcomes if o.kind != "ok" and o.status != 503]),
        "wall_s": round(time.monotonic() - t0, 1),
    }


# ---- d. schemathesis
def schemathesis_run(run: Run, examples: int, max_tokens: int) -> dict:
    declared, results = faults.fuzz_app(run.url, examples, max_tokens=max_tokens, timeout_s=run.timeout_s)
    return {
        "examples_per_operation_and_mode": examples,
        "max_tokens": max_tokens,
        "bodies_declared": declared,
        "cases": {name: r.cases for name, r in results.items()},
        "statuses": {name: {str(k): v for k, v in sorted(r.statuses.items())} for name, r in results.items()},
        "server_errors": {name: r.server_errors for name, r in results.items() if r.server_errors},
    }


# ---- e. soak
def soak_run(run: Run, n: int, concurrency: int) -> dict:
    argv = ["--url", run.url, "--requests", str(n), "--concurrency", str(concurrency)]
    argv += ["--max-tokens", str(run.max_tokens), "--timeout-s", str(run.timeout_s), "--server-pid", str(run.pid)]
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only this run's summary
        return soak.main(argv)


# ---- the run
def wait_healthy(run: Run) -> bool:
    """Between phases: /healthz 200 and nothing in flight, within the recovery timeout."""
    if faults.wait_status(run.url, 200, run.recovery_timeout_s) is None:
        return False
    deadline = time.monotonic() + run.recovery_timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            s = faults.stats(run.url)
            if (s["running"], s["waiting"], s["in_flight"]) == (0, 0, 0):
                return True
        time.sleep(0.5)
    return False


def phases(run: Run, args) -> list[tuple[str, Callable[[], dict]]]:
    out = [
        ("drafter_kill", lambda: drafter_fault(run)),
        ("tp_rank_kill", lambda: tp_fault(run)),
        ("overload", lambda: overload(run)),
        ("schemathesis", lambda: schemathesis_run(run, args.fuzz_examples, args.fuzz_max_tokens)),
    ]
    if args.soak:
        out.append(("soak", lambda: soak_run(run, args.soak, args.soak_concurrency)))
    return out


def run_phases(run: Run, args) -> dict:
    """Each phase in turn, each after the app is healthy and idle again; a phase that raises is
    recorded and the next runs; once the app does not come back, the rest are skipped."""
    out: dict[str, dict] = {}
    for name, phase in phases(run, args):
        if not wait_healthy(run):
            out[name] = {"skipped": f"the app was not healthy and idle within {run.recovery_timeout_s:g} s"}
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


def profile_path(profile: str) -> Path:
    path = Path(profile)
    return path if path.suffix in (".yaml", ".yml") else PROFILES / f"{profile}.yaml"


def app_args(path: Path) -> dict:
    """The first application's args in a Serve config (the profile's max_batch, max_waiting)."""
    return yaml.safe_load(path.read_text())["applications"][0].get("args", {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if "cases" in fz:
        statuses: dict[str, int] = {}
        for per_op in fz["statuses"].values():
            for k, v in per_op.items():
                statuses[k] = statuses.get(k, 0) + v
        fives = sum(v for k, v in statuses.items() if k.startswith("5"))
        ok = sum(v for k, v in statuses.items() if k.startswith("2"))
        note = f"statuses {statuses}; 5xx: {fives}"
        rows.append(["schemathesis", sum(fz["cases"].values()), ok, sum(statuses.values()) - ok, "", "", note])
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
    p.add_argument("--profile", default="cpu-default", help="a name in deployments/ or a Serve config YAML")
    p.add_argument("--tiny", action="store_true", help="tiny random models (a fast check of the run itself)")
    p.add_argument("--port", type=int, default=0, help="the server's port on 127.0.0.1 (0: a free one)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the server's Ray")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens of the short requests")
    p.add_argument("--inflight-tokens", type=int, default=None, help="tokens of in-flight requests (64; tiny 400)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request with no answer by then is hung")
    p.add_argument("--start-timeout-s", type=float, default=1800.0, help="until the server says it is ready")
    p.add_argument("--recovery-timeout-s", type=float, default=600.0)
    p.add_argument("--fuzz-examples", type=int, default=faults.FUZZ_EXAMPLES, help="per operation and mode")
    p.add_argument("--fuzz-max-tokens", type=int, default=faults.FUZZ_MAX_TOKENS)
    p.add_argument("--soak", type=int, default=0, metavar="N", help="then loadtest/soak.py's run of N requests")
    p.add_argument("--soak-concurrency", type=int, default=8)
    p.add_argument("--grace-s", type=float, default=30.0, help="the server's grace period when this run stops it")
    p.add_argument("--server-log", default=None, help="write the server's output here")
    args = p.parse_args(argv)
    if args.inflight_tokens is None:
        args.inflight_tokens = 400 if args.tiny else 64
    if not profile_path(args.profile).is_file():
        p.error(f"--profile: no such config {profile_path(args.profile)}")
    return args


def start(args) -> tuple[faults.ServeProcess, float]:
    port = args.port or free_port()
    t0 = time.monotonic()
    server = faults.ServeProcess(
        port, tiny=args.tiny, config=str(profile_path(args.profile)), grace_s=args.grace_s, num_cpus=args.num_cpus
    )
    log(f"started `fly-serve serve` (pid {server.proc.pid}) on {server.url}; waiting until ready")
    return server, t0


def stop(server: faults.ServeProcess, args) -> dict:
    """SIGTERM, then the process group; which of the server's processes outlived it."""
    before = descendants(server.proc.pid)
    t0 = time.monotonic()
    rc = server.stop(timeout_s=args.grace_s + 90)
    time.sleep(2)  # Ray workers end when their raylet does
    left = [p for p in before if faults.alive(p)]
    log(f"server stopped (exit {rc}) in {time.monotonic() - t0:.1f} s; of its {len(before)} processes left: {left}")
    if args.server_log:
        Path(args.server_log).write_text("\n".join(server.lines) + "\n")
    return {"exit_code": rc, "stop_s": round(time.monotonic() - t0, 1), "processes_left": left}


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:  # the server is gone already
        return []


def main(argv=None) -> dict:
    args = parse(argv)
    # a SIGTERM to this run ends it through `finally`, which stops the server it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prof = app_args(profile_path(args.profile))
    server, t0 = start(args)
    summary: dict = {
        "profile": str(profile_path(args.profile).relative_to(faults.ROOT)),
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
        run = Run(
            server,
            args.max_tokens,
            args.inflight_tokens,
            args.timeout_s,
            args.recovery_timeout_s,
            int(prof.get("max_batch", 8)),
            int(prof.get("max_waiting", 16)),
        )
        summary |= run_phases(run, args)
    finally:
        summary["server_stop"] = stop(server, args)
    print(json.dumps(summary, indent=1))
    print()
    print(table(summary))
    return summary


if __name__ == "__main__":
    main()
