"""Prometheus metrics of the round loop, vLLM-style names (vllm:spec_decode_* -> fly_spec_decode_*).
Exported by Ray's metrics agent (ray.serve.metrics adds deployment/replica tags)."""

from ray.serve import metrics

from fly_serve.contracts import RoundResult

SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
BATCH = [1, 2, 4, 8, 16, 32, 64, 128]


def inc(counter, n, tags=None):
    """Ray counters reject 0."""
    if n > 0:
        counter.inc(n, tags=tags)


class RoundMetrics:
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
        self.finished = c("fly_num_requests_finished", "Finished requests.", tag_keys=("finish_reason",))
        self.mean_len = metrics.Gauge(
            "fly_spec_decode_mean_acceptance_length", "Tokens committed per sequence per round since start (tau)."
        )
        self.phase = metrics.Histogram(
            "fly_round_phase_seconds", "Round time by phase.", boundaries=SECONDS, tag_keys=("phase",)
        )
        self.batch = metrics.Histogram("fly_batch_size", "Sequences per round.", boundaries=BATCH)
        self.seq_rounds = 0
        self.total_emitted = 0

    def round(self, r: RoundResult) -> None:
        inc(self.num_drafts, r.drafting_rows)
        inc(self.draft_tokens, r.drafted)
        inc(self.accepted, r.accepted)
        inc(self.loose, r.loosely_accepted)
        inc(self.emitted, r.emitted)
        self.seq_rounds += r.batch_size
        self.total_emitted += r.emitted
        self.mean_len.set(self.total_emitted / self.seq_rounds)
        for phase, seconds in (("draft", r.draft_s), ("verify", r.verify_s), ("decide", r.decide_s)):
            self.phase.observe(seconds, tags={"phase": phase})
        self.batch.observe(r.batch_size)

    def done(self, finish_reason: str) -> None:
        self.finished.inc(tags={"finish_reason": finish_reason})
