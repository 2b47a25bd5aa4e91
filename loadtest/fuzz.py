"""schemathesis against the app's own OpenAPI schema: every POST route whose body the schema
declares, positive (valid) and negative (invalid) bodies, and no answer may be a 5xx.

The cases are drawn anew on every run (a fresh seed, reported, so a failure can be replayed with
that seed): a green run proves only the cases it drew, so each run draws others. Cases that once
found a bug are pinned as explicit tests elsewhere, and the hostile bodies no schema-driven case
draws (JSON nested past the parser, grammars the library cannot follow: issue 47) are sent on
every run too, each with the status it must get (`PINNED`)."""

import json
import random
from dataclasses import dataclass, field

import requests

from .client import CLIENT_TIMEOUT_S, post_raw
from .scenarios import GRAMMAR_FAILURES, LATE_DEAD_END, NESTED_BODIES, PROMPT, STOP_CASES

CASES_PER_ROUTE = 50  # the default suite's short run; the fault run draws 1,000+ per route
MAX_TOKENS = 8  # fuzzed bodies ask for at most this many tokens: the fuzz is about shapes
# schemathesis reports a failed check as a FailureGroup, a BaseExceptionGroup and not an Exception:
# `except Exception` alone lets a 5xx escape unrecorded
FAILURES = (Exception, BaseExceptionGroup)


@dataclass
class RouteFuzz:
    """One route in one generation mode."""

    route: str  # "POST /v1/completions"
    mode: str  # "positive" or "negative"
    seed: int
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)  # status code -> count
    server_errors: list[str] = field(default_factory=list)  # the first 5xx ends the route's run


# (path, raw body, the status it must get): a 400 each, where they were a 500 (nested JSON, a
# lone surrogate in a grammar, a grammar's dead end after 51 tokens) or a 200 "stop" with no text
# (a grammar the library gave up on at its first token, or that nothing completes); stop lists
# past OpenAI's bound a 400, at it a 200 (issue 54)
PINNED: dict[str, tuple[str, bytes, int]] = {
    **{name: ("/v1/completions", raw, 400) for name, raw in NESTED_BODIES.items()},
    **{
        name: (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": PROMPT}], **extra}).encode(),
            400,
        )
        for name, extra in GRAMMAR_FAILURES.items()
    },
    "late_grammar_dead_end": ("/v1/completions", json.dumps({"prompt": PROMPT, **LATE_DEAD_END}).encode(), 400),
    **{
        name: ("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stop": stop}).encode(), want)
        for name, (stop, want) in STOP_CASES.items()
    },
}


@dataclass
class FuzzRun:
    seed: int  # the run's seed: each route and mode draws from seed + its index
    declared: list[str]  # POST paths whose request body the served schema declares
    routes: list[RouteFuzz]
    asked_per_route: int  # cases asked for; a route that got fewer stopped at a 5xx (or ran dry)
    pinned: dict[str, int | None] = field(default_factory=dict)  # PINNED's case -> its status (None: no answer)

    @property
    def pinned_wrong(self) -> dict[str, int | None]:
        """The pinned cases that did not get the status they must."""
        return {name: got for name, got in self.pinned.items() if got != PINNED[name][2]}

    def cases_per_route(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.routes:
            out[r.route] = out.get(r.route, 0) + r.cases
        return out

    @property
    def server_errors(self) -> dict[str, list[str]]:
        out = {f"{r.route} ({r.mode})": r.server_errors for r in self.routes if r.server_errors}
        fives = [name for name, got in self.pinned.items() if got is not None and got >= 500]
        return out | ({"pinned": fives} if fives else {})

    def statuses(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.routes:
            for status, n in r.statuses.items():
                out[status] = out.get(status, 0) + n
        return dict(sorted(out.items()))

    def summary(self) -> dict:
        statuses = {f"{r.route} ({r.mode})": {str(k): n for k, n in sorted(r.statuses.items())} for r in self.routes}
        return {
            "seed": self.seed,
            "bodies_declared": self.declared,
            "cases_per_route": self.cases_per_route(),
            "routes_short_of_cases": [r for r, n in self.cases_per_route().items() if n < self.asked_per_route],
            "statuses": statuses,
            "server_errors": self.server_errors,
            "pinned": self.pinned,
            "pinned_wrong": self.pinned_wrong,
        }


def served_openapi(url: str) -> tuple[dict, list[str]]:
    """The app's own /openapi.json, and the POST routes whose request body it declares (the
    fuzz sends bodies only where the schema says what they are)."""
    doc = requests.get(f"{url}/openapi.json", timeout=30).json()
    declared = [path for path, ops in doc["paths"].items() if "requestBody" in ops.get("post", {})]
    return doc, declared


def small(case, max_tokens: int):
    """Fuzzed bodies ask for few tokens (each case is a real generation)."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and case.body[name] > max_tokens:
                case.body[name] = max_tokens
    return case


def fuzz_route(op, mode, url: str, session, out: RouteFuzz, examples: int, max_tokens: int, timeout_s: float) -> None:
    """Up to `examples` cases of one operation in one mode, drawn from out.seed, into `out`. A 5xx is
    recorded (and ends this route's run); anything else that fails raises."""
    from hypothesis import HealthCheck, given, seed, settings
    from schemathesis.checks import not_a_server_error

    @seed(out.seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode).map(lambda case: small(case, max_tokens)))
    def run(case):
        out.cases += 1
        response = case.call(base_url=url, session=session, timeout=timeout_s)
        out.statuses[response.status_code] = out.statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except FAILURES:
            out.server_errors.append(f"{response.status_code} {case.body!r:.300} -> {response.text[:300]}")
            raise

    try:
        run()
    except FAILURES as e:  # a server error is in out.server_errors; anything else is the caller's
        if not out.server_errors:
            raise AssertionError(f"{out.route} ({out.mode}, seed {out.seed}): {e!r}") from e


def fuzz_app(
    url: str,
    cases_per_route: int = CASES_PER_ROUTE,
    max_tokens: int = MAX_TOKENS,
    timeout_s: float = CLIENT_TIMEOUT_S,
    seed: int | None = None,
) -> FuzzRun:
    """Every POST route with a declared body, half its cases positive and half negative."""
    import schemathesis

    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    doc, declared = served_openapi(url)
    schema = schemathesis.openapi.from_dict(doc)
    session = requests.Session()
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    per_mode = -(-cases_per_route // len(modes))
    routes = []
    for op in (result.ok() for result in schema.include(method="POST").get_all_operations()):
        for mode in modes:
            out = RouteFuzz(f"{op.method.upper()} {op.path}", mode.value, seed + len(routes))
            fuzz_route(op, mode, url, session, out, per_mode, max_tokens, timeout_s)
            routes.append(out)
    pinned = {name: post_raw(url, raw, path, timeout_s).status for name, (path, raw, _) in PINNED.items()}
    return FuzzRun(seed, declared, routes, per_mode * len(modes), pinned)
