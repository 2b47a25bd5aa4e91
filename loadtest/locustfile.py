"""Locust load test of /v1/completions on a local fly-serve (127.0.0.1 only).

Each user sends one completion at a time, so the number of users is the number of concurrent
requests, i.e. the engine's batch size. Bounded: --run-time caps the time and
FLY_MAX_REQUESTS caps each user's requests. Headless runs for 1, 4 and 8 users: run.sh.
Prompts: fly_bench.prompts.COMPLETIONS.
Env: FLY_MODE (fly|ar|spd|pld, default fly), FLY_MAX_TOKENS (default 32), FLY_MAX_REQUESTS (default 20).
"""

import os
from urllib.parse import urlparse

from locust import HttpUser, between, events, task
from locust.exception import StopUser

from fly_bench.prompts import COMPLETIONS as PROMPTS

MODE = os.environ.get("FLY_MODE", "fly")
MAX_TOKENS = int(os.environ.get("FLY_MAX_TOKENS", "32"))
MAX_REQUESTS = int(os.environ.get("FLY_MAX_REQUESTS", "20"))


@events.init.add_listener
def _local_only(environment, **kwargs):
    host = urlparse(environment.host or "").hostname
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"locustfile: refusing to load {environment.host!r}; only 127.0.0.1 is allowed")


class CompletionUser(HttpUser):
    wait_time = between(0, 0.1)

    def on_start(self):
        self.sent = 0

    @task
    def complete(self):
        if self.sent >= MAX_REQUESTS:
            raise StopUser()
        prompt = PROMPTS[self.sent % len(PROMPTS)]
        self.sent += 1
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "fly": {"mode": MODE}}
        with self.client.post("/v1/completions", json=body, name=f"/v1/completions [{MODE}]", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            out = r.json()
            tokens = out["usage"]["completion_tokens"]
            if tokens < 1:
                r.failure("no tokens")
                return
            # tokens/s per request, as a custom "request" row in Locust's table
            events.request.fire(
                request_type="TOKENS",
                name=f"completion_tokens [{MODE}]",
                response_time=r.elapsed.total_seconds() * 1000,
                response_length=tokens,
                exception=None,
                context={},
            )
