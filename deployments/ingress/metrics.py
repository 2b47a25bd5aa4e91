"""Prometheus metrics of the ingress: the round loop's (vLLM-style names, vllm:spec_decode_* ->
fly_spec_decode_*) and the requests' (vllm:num_requests_waiting -> fly_num_requests_waiting, time to
first token, time per output token, failures by reason). Exported by Ray's metrics agent
(ray.serve.metrics adds deployment/replica tags)."""

from ray.serve import metrics

from fly_serve.contracts import RoundResult

from .engine_loop import round_timeline

SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
BATCH = [1, 2, 4, 8, 16, 32, 64, 128]
# vLLM's buckets, stretched at the top: a first token on a CPU can wait behind whole prefills
TTFT_SECONDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640]
TPOT_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10]
FAILURE_REASONS = ("rejected", "overloaded", "error")  # a 4xx, a 503, a 5xx (a failed round among them)


def inc(counter, n, tags=None):
    """Ray counters reject 0."""
    if n > 0:
        counter.inc(n, tags=tags)


class ServingMetrics:
    """Created once per ingress replica; the engine thread reports rounds, queue sizes and request
    timings, the HTTP handlers report the requests they turn away."""

    def __init__(self):
        c = metrics.Counter
        self.num_drafts = c("fly_spec_decode_num_drafts", "Draft proposals (one per sequence per round).")
        self.draft_tokens = c("fly_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted = c("fly_spec_decode_num_accepted_tokens", "Draft tokens accepted (exact match).")
        self.loose = c(
            "fly_spec_decode_num_loosely_accepted_tokens",
            "Draft tokens kept by FLy's entropy gate and window despite a mismatch.",
        )
        self.emitted = c("fly_spec_decode_num_emitted_tokens", "Tokens committed (drafts + target token).")
        # draft-ahead (fly_serve/drafting/draft_ahead.py); the waits are phases of fly_round_phase_seconds
        self.ahead_hits = c(
            "fly_draft_ahead_hits", "Rows whose next drafts were made while their round was verified, and kept."
        )
        self.ahead_misses = c("fly_draft_ahead_misses", "Rows whose ahead drafts were dropped (the verdict differed).")
        self.ahead_dropped = c("fly_draft_ahead_dropped_tokens", "Ahead draft tokens thrown away with the misses.")
        self.finished = c("fly_num_requests_finished", "Finished requests.", tag_keys=("finish_reason",))
        self.mean_len = metrics.Gauge(
            "fly_spec_decode_mean_acceptance_length", "Tokens committed per sequence per round since start (tau)."
        )
        self.phase = metrics.Histogram(
            "fly_round_phase_seconds",
            "Round time by phase (engine_loop.TIMELINE); a call minus its compute is transport.",
            boundaries=SECONDS,
            tag_keys=("phase",),
        )
        self.batch = metrics.Histogram("fly_batch_size", "Sequences per round.", boundaries=BATCH)
        self.waiting = metrics.Gauge("fly_num_requests_waiting", "Requests admitted, waiting for a place in the batch.")
        self.running = metrics.Gauge("fly_num_requests_running", "Requests in the running batch.")
        self.ttft = metrics.Histogram(
            "fly_time_to_first_token_seconds", "From arrival to the first generated token.", boundaries=TTFT_SECONDS
        )
        self.tpot = metrics.Histogram(
            "fly_time_per_output_token_seconds",
            "Per request: time after the first token / the tokens after it.",
            boundaries=TPOT_SECONDS,
        )
        self.failed = c(
            "fly_num_requests_failed",
            "Requests that failed: rejected (4xx), overloaded (503), error (5xx, a failed round).",
            tag_keys=("reason",),
        )
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens, per model ("part")
        self.prefix_queries = c(
            "fly_prefix_cache_queries", "Prompt tokens of requests that started (looked up in the prefix cache)."
        )
        self.prefix_hits = c(
            "fly_prefix_cache_hits",
            "Prompt tokens taken from the prefix cache instead of prefilled, by model (target, drafter).",
            tag_keys=("part",),
        )
        self.seq_rounds = 0
        self.total_emitted = 0

    def round(self, r: RoundResult) -> None:
        inc(self.num_drafts, r.drafting_rows)
        inc(self.draft_tokens, r.drafted)
        inc(self.accepted, r.accepted)
        inc(self.loose, r.loosely_accepted)
        inc(self.emitted, r.emitted)
        inc(self.ahead_hits, r.ahead_hits)
        inc(self.ahead_misses, r.ahead_misses)
        inc(self.ahead_dropped, r.ahead_dropped)
        inc(self.prefix_queries, r.prompt_tokens)
        inc(self.prefix_hits, r.prefix_hit_tokens, {"part": "target"})
        inc(self.prefix_hits, r.draft_prefix_hit_tokens, {"part": "drafter"})
        self.seq_rounds += r.batch_size
        self.total_emitted += r.emitted
        self.mean_len.set(self.total_emitted / self.seq_rounds)
        for phase, seconds in round_timeline(r).items():
            self.phase.observe(seconds, tags={"phase": phase})
        self.batch.observe(r.batch_size)

    def done(self, finish_reason: str) -> None:
        self.finished.inc(tags={"finish_reason": finish_reason})

    def queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def per_output_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def failure(self, reason: str) -> None:
        self.failed.inc(tags={"reason": reason})
