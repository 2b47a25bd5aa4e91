"""One fault run against live `fly-serve serve` apps that this run starts (127.0.0.1 only) and
stops, even on error: the scenarios of scenarios.py and fuzz.py in sequence, their results printed.
Each scenario runs on the profile that has what it needs (`--replica-profile` for the kills, `--profile`
for the rest), one server at a time, and its result names that profile:

  on --replica-profile (default cpu-tp2: a drafter replica, FlyDrafter, and a TP group of the target):
  a. the drafter replica SIGKILLed mid-generation (2 plain + 1 streaming requests in flight):
     how each in-flight request ended, seconds until a new drafter replica drafts with the model;
  b. one TP rank SIGKILLed mid-generation: how each in-flight request ended, seconds until
     /healthz says 503 (if it does) and until a request succeeds again;
  on --profile (default cpu-default, the app as `fly-serve serve` starts it):
  c. overload: 4 x max_batch + max_waiting concurrent short requests: 200 / 503 / other / hung;
  d. hostile input beside requests in flight: JSON nested past the parser, grammars the library
     cannot follow or that no text completes, at once or after 51 tokens, stop lists past OpenAI's
     bound, lone surrogates in a grammar (each a 400, a stream's dead end an error event of the
     client's type), and max_batch + max_waiting + 4 slow bodies (each a 408 after the profile's
     body_timeout_s, while requests beside them are served); 5xx answers counted (0 expected);
  d2. slow_flood: 3x the ingress's Serve limit (max_ongoing_requests) in slow-body sockets:
     /healthz p99 and a streamed request's time to first token beside them against idle, lost
     requests (goals: p99 <= 2 s, TTFT <= 2x idle, 0 lost);
  e. schemathesis against the app's own OpenAPI schema, 1,000 fresh cases per route by default
     (a new seed each run, printed), and fuzz.PINNED's hostile bodies: status codes, and every 5xx;
  f. (--soak N) soak.py's long run of N requests: outcomes, RSS at its start and end;
  on the multi-node profile that survives its head (deployments/profiles/cpu-multinode-ha.yaml on
  `python -m deployments.local_cluster --ha`: the GCS on a Redis, a head with no replica, a proxy on
  every node):
  g. the head killed (its GCS and raylet; Serve's controller and the head's proxy with them) while
     requests stream through the frontend node's proxy, kept down HEAD_DOWN_S, then restarted on the
     same Redis: how the in-flight requests ended, how those sent to the frontend's proxy meanwhile
     ended (each answered, or a 503 with Retry-After, counted), seconds until the app is RUNNING.

    python -m loadtest.fault_run                       # the real pair on cpu-tp2, then cpu-default
    python -m loadtest.fault_run --tiny --fuzz-cases 100   # tiny random models: a check in minutes
    python -m loadtest.fault_run --tiny --only drafter_kill  # one scenario (its profile's server only)
    python -m loadtest.fault_run --tiny --only head_kill     # the head's loss on a local multi-node cluster
    python -m loadtest.fault_run --soak 500 --port 8011

Prints ONE JSON summary and a markdown table on stdout (progress goes to stderr), and exits 1 when
a scenario failed: it raised (a profile with no drafter replica or no TP ranks to kill among them),
its server never became ready, or the app was not healthy and idle before it. Every wait has a
timeout; a request with no answer within --timeout-s counts as hung. Only processes this run
started are killed (procs.kill_ours checks that they descend from it).
"""

import argparse
import contextlib
import json
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from . import fuzz, soak
from .client import InFlight, Tally, complete, failures
from .procs import alive, descendants, kill_ours
from .scenarios import BODY_TIMEOUT_S, PROMPT, App, drafter_kill, hostile_input, overload, slow_flood, tp_rank_kill
from .server import ROOT, ClusterProcess, ServeProcess, profile_path
from .waits import until, wait_generating, wait_healthy

HEAD_DOWN_S = 10.0  # the head stays down this long while requests keep coming (then its restart takes more)
HA_PROFILE = "deployments/profiles/cpu-multinode-ha.yaml"


def log(msg: str) -> None:
    print(f"[fault_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def soak_run(app: App, args) -> dict:
    argv = ["--url", app.url, "--requests", str(args.soak), "--concurrency", str(args.soak_concurrency)]
    argv += ["--max-tokens", str(args.max_tokens), "--timeout-s", str(app.timeout_s), "--server-pid", str(app.root_pid)]
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only this run's summary
        return soak.main(argv)


def hostile_summary(run) -> dict:
    """The hostile scenario's summary; a run where a hostile request was not refused as it
    must be, or something beside it was lost, fails the phase."""
    out = run.summary()
    if not run.held:
        out["failed"] = "a hostile request was not refused as it must be, or a request beside it was lost"
    return out


def flood_summary(run) -> dict:
    """The slow flood's summary; /healthz not answered in time beside it, a request lost, or a
    socket not cut with a 408 fails the phase (the time to first token is reported against its goal)."""
    out = run.summary()
    if not run.held:
        out["failed"] = (
            "/healthz was slow or unanswered beside the slow bodies, a request was lost, or a socket not cut"
        )
    return out


def fuzz_run(app: App, args) -> dict:
    run = fuzz.fuzz_app(app.url, args.fuzz_cases, args.fuzz_max_tokens, app.timeout_s, args.fuzz_seed)
    return run.summary()


# The kills need processes to kill: a drafter replica and a TP group's ranks, which the default
# profile (drafter and target inside the ingress process) does not have.
REPLICA_PHASES = ("drafter_kill", "tp_rank_kill")
APP_PHASES = ("overload", "hostile", "slow_flood", "schemathesis", "soak")
CLUSTER_PHASES = ("head_kill",)  # on a local multi-node cluster of its own
PHASES = REPLICA_PHASES + APP_PHASES + CLUSTER_PHASES


def phases(app: App, args, prof: dict) -> dict[str, Callable[[], dict]]:
    """Every scenario by name, to run against `app` (prof: its profile's args)."""
    max_batch, max_waiting = int(prof.get("max_batch", 8)), int(prof.get("max_waiting", 16))
    body_timeout_s = float(prof.get("body_timeout_s", BODY_TIMEOUT_S))
    slots = max_batch + max_waiting
    return {
        "drafter_kill": lambda: drafter_kill(app, args.inflight_tokens, args.max_tokens).summary(),
        "tp_rank_kill": lambda: tp_rank_kill(app, args.inflight_tokens, args.max_tokens).summary(),
        "overload": lambda: overload(app, max_batch, max_waiting, args.max_tokens).summary(),
        "hostile": lambda: hostile_summary(hostile_input(app, slots, body_timeout_s, args.inflight_tokens, 4)),
        "slow_flood": lambda: flood_summary(slow_flood(app, body_timeout_s, args.max_tokens)),
        "schemathesis": lambda: fuzz_run(app, args),
        "soak": lambda: soak_run(app, args),
    }


def plan(args) -> list[tuple[Path, list[str]]]:
    """The servers to start, one after the other, each with the scenarios it runs: the kills on
    --replica-profile, the rest on --profile (one server when both name the same)."""
    chosen = args.only or [name for name in PHASES if name != "soak" or args.soak]
    out: dict[Path, list[str]] = {}
    for profile, names in ((args.replica_profile, REPLICA_PHASES), (args.profile, APP_PHASES)):
        picked = [name for name in names if name in chosen]
        if picked:
            out.setdefault(profile_path(profile), []).extend(picked)
    return list(out.items())


def run_phases(app: App, args, prof: dict, names: list[str]) -> dict:
    """Each scenario in turn, each after the app is healthy and idle again; one that raises, or
    that the app is not healthy for, is recorded as failed and the next runs."""
    out: dict[str, dict] = {}
    scenario = phases(app, args, prof)
    for name in names:
        if not wait_healthy(app.url, app.recovery_timeout_s):
            out[name] = {"failed": f"the app was not healthy and idle within {app.recovery_timeout_s:g} s"}
            log(f"{name}: failed (not healthy)")
            continue
        log(f"{name} ...")
        t0 = time.monotonic()
        try:
            out[name] = scenario[name]()
        except Exception as e:
            out[name] = {"failed": repr(e)[:500]}
        out[name]["phase_s"] = round(time.monotonic() - t0, 1)
        log(f"{name}: {'failed' if 'failed' in out[name] else 'done'} in {out[name]['phase_s']} s")
    return out


def head_kill(args) -> dict:
    """g: the local cluster with a GCS store (its own process, stopped after); the head killed and
    restarted through the cluster's signals (local_cluster.HeadControl), requests through the
    frontend node's proxy all along."""
    cluster = ClusterProcess(args.port, ["--ha", *(["--tiny"] if args.tiny else [])])
    log(f"started `python -m deployments.local_cluster --ha` (pid {cluster.pid}) for head_kill")
    try:
        if not cluster.ready(args.start_timeout_s):
            return {"failed": "the cluster did not become ready: " + " | ".join(cluster.lines[-5:])}
        proxy = re.compile(r"frontend \S+ proxy (\S+)")  # the line after "ready"
        [front] = until(lambda: [m[1] for m in map(proxy.search, cluster.lines) if m] or None, 30) or [None]
        if front is None:
            return {"failed": "the cluster named no frontend proxy: " + " | ".join(cluster.lines[-5:])}
        fly = {"mode": "fly", "k": 2, "window": 1}  # many rounds each: still running at the kill
        body = {"prompt": PROMPT, "max_tokens": args.inflight_tokens, "fly": fly}
        flight = InFlight(front, body, timeout_s=args.timeout_s)
        wait_generating(front, len(flight), timeout_s=args.timeout_s, rounds=2)
        t_kill = time.monotonic()
        kill_ours(cluster.pid, signal.SIGUSR1)
        short = {"prompt": PROMPT, "max_tokens": args.max_tokens, "fly": fly}
        during = []
        while time.monotonic() - t_kill < HEAD_DOWN_S:
            during.append(complete(front, short, timeout_s=args.timeout_s))
        killed = cluster.wait_for("local-cluster: head killed", 60)
        kill_ours(cluster.pid, signal.SIGUSR2)
        t_restart = time.monotonic()
        while not any("local-cluster: app RUNNING" in line for line in cluster.lines):
            if time.monotonic() - t_restart > args.recovery_timeout_s:
                break
            during.append(complete(front, short, timeout_s=args.timeout_s))
        in_flight = flight.gather(args.timeout_s + 30)
        shed = [o for o in during if o.kind == "error" and o.status == 503 and o.retry_after]
        running = [line for line in cluster.lines if "local-cluster: app RUNNING" in line or "head restarted" in line]
        return {
            "profile": HA_PROFILE,
            "head_killed": killed,
            "in_flight": vars(Tally.of(in_flight)),
            "in_flight_finished_normally": sum(o.finished_normally for o in in_flight),
            "while_down": vars(Tally.of(during)),
            "shed_503_retry_after": len(shed),
            "failures_while_down": failures([o for o in during if o not in shed]),
            "longest_while_down_s": round(max((o.ended - o.started for o in during), default=0.0), 2),
            "recovery": [line.removeprefix("local-cluster: ") for line in running],
        }
    finally:
        cluster.stop(timeout_s=120)


def app_args(path: Path) -> dict:
    """The first application's args in a Serve config (the profile's max_batch, max_waiting)."""
    return yaml.safe_load(path.read_text())["applications"][0].get("args", {})


def shown(path: Path) -> str:
    """A profile as the summary names it: relative to the repository where it lies in it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run_server(config: Path, names: list[str], args) -> tuple[dict, dict]:
    """One `fly-serve serve` on `config`, its scenarios, its stop: (the server's record, each
    scenario's result with the profile it ran on)."""
    t0 = time.monotonic()
    server = ServeProcess(args.port, tiny=args.tiny, config=str(config), grace_s=args.grace_s, num_cpus=args.num_cpus)
    log(f"started `fly-serve serve` on {shown(config)} (pid {server.pid}) on {server.url} for {names}")
    record: dict = {"profile": shown(config), "scenarios": names, "url": server.url}
    try:
        if server.wait_for("fly-serve: ready", args.start_timeout_s):
            record["start_s"] = round(time.monotonic() - t0, 1)
            app = App(server.url, server.pid, args.timeout_s, args.recovery_timeout_s)
            results = run_phases(app, args, app_args(config), names)
        else:
            log("the server did not become ready; its last lines:\n" + "\n".join(server.lines[-40:]))
            rc = server.proc.poll()
            ended = f"exited ({rc})" if rc is not None else f"was not ready within {args.start_timeout_s:g} s"
            reason = f"`fly-serve serve` on {shown(config)} {ended}"
            results = {name: {"failed": reason} for name in names}
    finally:
        record["server_stop"] = stop(server, args)
    return record, {name: {"profile": shown(config), **result} for name, result in results.items()}


# ---- output
def _cells(t: dict) -> list:
    return [t.get(k, "") for k in ("sent", "answered", "errored", "dropped", "hung")]


def table(summary: dict) -> str:
    """The markdown table of the run: one row per fault (and the requests after it), each with
    the profile it ran on."""
    rows: list[list] = []  # each row's first cell: the scenario it belongs to
    d, tp, ov = summary.get("drafter_kill", {}), summary.get("tp_rank_kill", {}), summary.get("overload", {})
    fz, sk = summary.get("schemathesis", {}), summary.get("soak")
    ho, sf = summary.get("hostile", {}), summary.get("slow_flood", {})
    if "in_flight" in d:
        back = "no new replica drafted" if d["recovery_s"] is None else f"drafting again after {d['recovery_s']} s"
        note = f"{back} (pid {d['drafter_pid']})"
        rows.append(
            ["drafter_kill", "drafter replica SIGKILL: in flight (2 plain, 1 stream)", *_cells(d["in_flight"]), note]
        )
        note = f"drafted {d['later_drafted']}"
        rows.append(["drafter_kill", "drafter replica SIGKILL: later requests", *_cells(d["later_requests"]), note])
    if "in_flight" in tp:
        went, back = tp["healthz_503_s"], tp["healthz_200_again_s"]
        health = "/healthz never 503" if went is None else f"/healthz 503 after {went} s (200 again after {back} s)"
        first = tp["first_success_s"]
        note = f"{health}; " + ("no success" if first is None else f"first success {first} s after the kill")
        rows.append(["tp_rank_kill", "TP rank SIGKILL: in flight (2 plain, 1 stream)", *_cells(tp["in_flight"]), note])
        note = f"until the first success: {tp['requests_until_success']}"
        rows.append(["tp_rank_kill", "TP rank SIGKILL: later requests", *_cells(tp["later_requests"]), note])
    if "counts" in ov:
        c = ov["counts"]
        note = f"503: {c['503']} {ov['503_error_codes']}, slowest {ov['max_s']['503']} s; other: {c['other']}"
        row = ["overload", f"overload ({ov['concurrent']} concurrent)", ov["concurrent"], c["200"]]
        rows.append([*row, c["503"] + c["other"], 0, c["hung"], note])
    if "nested" in ho:
        refused = [*ho["nested"].values(), *ho["grammar"].values()]
        sent = len(refused) + ho["slow_bodies"] + ho["beside_slow"]["sent"] + ho["in_flight"]["sent"]
        answered = ho["beside_slow"]["answered"] + ho["in_flight"]["answered"]
        answered += sum(r.startswith("200 None") for r in ho["stops"].values())
        note = f"refused {refused}; slow bodies {ho['slow_statuses']} after {max(ho['slow_answered_s'], default=0)} s"
        note += f"; in flight whole {ho['in_flight_finished_normally']}/{ho['in_flight']['sent']}"
        refused += [*ho["stops"].values(), *ho["late_dead_end"].values()]
        sent += len(ho["stops"]) + len(ho["late_dead_end"])
        note += f"; stops {ho['stops']}; late dead end {ho['late_dead_end']}; 5xx: {ho['status_500']}"
        rows.append(["hostile", "hostile input (nested JSON, grammars, stops, slow bodies)", sent, answered])
        errored = sum(not r.startswith("200 None") for r in refused) + ho["slow_bodies"]  # a stream's error event too
        rows[-1] += [errored, ho["in_flight"]["dropped"], ho["in_flight"]["hung"], note]
    if "ongoing_limit" in sf:
        note = f"/healthz p99 {sf['healthz_p99_beside_s']} s (idle {sf['healthz_p99_idle_s']}); TTFT "
        note += (
            f"{sf['ttft_beside_s']} s vs idle {sf['ttft_idle_median_s']} s ({sf['ttft_ratio']}x); goals {sf['goals']}"
        )
        note += f"; sockets {sf['slow_statuses']} after {sf['slow_answered_s_min_max']} s"
        n = sf["slow_sockets"]
        rows.append(["slow_flood", f"slow bodies, {n} sockets (3x Serve limit {sf['ongoing_limit']})", n])
        rows[-1] += ["", n, "", "", note]
    if "cases_per_route" in fz:
        statuses: dict[str, int] = {}
        for per_op in fz["statuses"].values():
            for k, v in per_op.items():
                statuses[k] = statuses.get(k, 0) + v
        fives = sum(v for k, v in statuses.items() if k.startswith("5"))
        ok = sum(v for k, v in statuses.items() if k.startswith("2"))
        note = f"seed {fz['seed']}; cases per route {fz['cases_per_route']}; statuses {statuses}; 5xx: {fives}"
        note += f"; pinned hostile bodies not as they must be: {fz.get('pinned_wrong') or 'none'}"
        cases = sum(fz["cases_per_route"].values())
        rows.append(["schemathesis", "schemathesis", cases, ok, sum(statuses.values()) - ok, "", "", note])
    if sk and "outcomes" in sk:
        o = sk["outcomes"]
        start, end = sum(sk["rss_mib_start"].values()), sum(sk["rss_mib_end"].values())
        errored = o.get("rejected", 0) + o.get("shed", 0) + o.get("unexpected", 0)
        note = f"{o}; RSS of the app's processes {start:.0f} -> {end:.0f} MiB"
        rows.append(["soak", f"soak ({sk['requests']} requests)", sk["requests"], o.get("answered", 0), errored])
        rows[-1] += [o.get("client_left", 0), o.get("hung", 0), note]
    hk = summary.get("head_kill", {})
    if "in_flight" in hk:
        note = f"{hk['in_flight_finished_normally']} whole; {'; '.join(hk['recovery']) or 'no recovery line'}"
        rows.append(["head_kill", "head SIGKILL: in flight (2 plain, 1 stream)", *_cells(hk["in_flight"]), note])
        note = f"503 with Retry-After: {hk['shed_503_retry_after']}; longest {hk['longest_while_down_s']} s"
        note += f"; other failures: {hk['failures_while_down'] or 'none'}"
        rows.append(["head_kill", "head down: requests to a worker node's proxy", *_cells(hk["while_down"]), note])
    for name in PHASES:
        if "failed" in (summary.get(name) or {}):
            rows.append([name, name, "", "", "", "", "", f"FAILED: {summary[name]['failed']}"])
    head = ["fault", "sent", "answered", "errored", "dropped", "hung", "recovery / notes", "profile"]
    cells = [head] + [[*row[1:], (summary.get(row[0]) or {}).get("profile", "")] for row in rows]
    lines = ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    lines.insert(1, "|" + "---|" * len(head))
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--profile",
        default="cpu-default",
        help="the profile of overload, schemathesis and soak: a name in deployments/profiles/ or a Serve config YAML",
    )
    # cpu-tp2: the CPU profile with a drafter replica and a TP group, so that both kills have a target
    p.add_argument(
        "--replica-profile",
        default="cpu-tp2",
        help="the profile of the kills, with a drafter replica (FlyDrafter) and TP ranks (tp_size > 1)",
    )
    p.add_argument("--only", nargs="+", choices=PHASES, default=None, help="these scenarios only")
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
    p.add_argument("--server-log", default=None, help="write the servers' output here, one after the other")
    args = p.parse_args(argv)
    if args.inflight_tokens is None:
        args.inflight_tokens = 400 if args.tiny else 64
    if args.only and "soak" in args.only and not args.soak:
        p.error("--only soak: give the soak's length with --soak N")
    for flag, profile in (("--profile", args.profile), ("--replica-profile", args.replica_profile)):
        if not profile_path(profile).is_file():
            p.error(f"{flag}: no such config {profile_path(profile)}")
    if args.server_log:
        Path(args.server_log).write_text("")  # each server's lines are appended as it stops
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
        with open(args.server_log, "a") as f:
            f.write("\n".join(server.lines) + "\n")
    return {"exit_code": rc, "stop_s": round(time.monotonic() - t0, 1), "processes_left": left}


def main(argv=None) -> dict:
    args = parse(argv)
    # a SIGTERM to this run ends it through `finally`, which stops the server it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    summary: dict = {
        "tiny": args.tiny,
        "max_tokens": args.max_tokens,
        "inflight_tokens": args.inflight_tokens,
        "timeout_s": args.timeout_s,
        "servers": [],
    }
    for config, names in plan(args):
        record, results = run_server(config, names, args)
        summary["servers"].append(record)
        summary |= results
    if "head_kill" in (args.only or PHASES):
        t0 = time.monotonic()
        try:
            summary["head_kill"] = head_kill(args)
        except Exception as e:
            summary["head_kill"] = {"profile": HA_PROFILE, "failed": repr(e)[:500]}
        summary["head_kill"]["phase_s"] = round(time.monotonic() - t0, 1)
    summary["failed"] = [name for name in PHASES if "failed" in summary.get(name, {})]
    print(json.dumps(summary, indent=1))
    print()
    print(table(summary))
    return summary


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
