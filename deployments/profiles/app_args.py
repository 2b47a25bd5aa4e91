"""The Serve app's arguments (a profile's `args:`), validated once. The engine's own knobs are
handed down as one fly_serve.config.EngineConfig (`engine_config()`); the rest say how the app is
laid out and how it stays up."""

import json
from dataclasses import fields
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from fly_serve.config import DrafterSpec, EngineConfig
from fly_serve.loading.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

from .placement import DEFAULT_TP_WORKER_OPTIONS

KV_BLOCK_TOKENS = 16  # the KV cache's block size: a smaller budget holds no block
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# A request body must have come whole within this (a body of max_body_bytes, 4 MiB, needs ~1.7
# Mbit/s): a client that declares a body and sends it drop by drop must hold a handler no longer
DEFAULT_BODY_TIMEOUT_S = 20.0
DEFAULT_MAX_WAITING = 32
DEFAULT_CALL_TIMEOUT_S = 120.0
DEFAULT_STUCK_ROUND_S = 1200.0
# The target replica's own limits (target_replica.py reads them from here)
DEFAULT_RANK_CALL_TIMEOUT_S = 60.0
DEFAULT_RANK_PING_TIMEOUT_S = 10.0
DEFAULT_TP_STARTUP_TIMEOUT_S = 600.0


def timeout(default: float, *old_names: str):
    """A timeout field, also accepted under the names it had before (older profiles)."""
    return Field(default, gt=0, validation_alias=AliasChoices(*old_names) if old_names else None)


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    target: str = DEFAULT_TARGET
    drafter: str | None = DEFAULT_DRAFTER  # None: no draft model (model-free modes only)
    # Several draft models by name, the first the default (`drafter` then unused), each its own
    # deployment and pool (FlyDrafter, FlyDrafter-<name>), scaled on its own busy time: {name:
    # model} or {name: {model: ..., greedy: string | tli}}; a request picks one (fly.drafter), else
    # k auto chooses per row. A drafter of another tokenizer drafts through the shared vocabulary.
    drafters: dict | None = None
    tiny: bool = False  # tiny random models ("tiny:0" target, "tiny:1" drafter), for tests
    dtype: str = "auto"
    drafter_precision: str = "auto"  # fly_serve.config.EngineConfig: applied or refused, never ignored
    tp_size: int = 1
    max_batch: int = 8
    max_model_len: int = 4096
    served_model_name: str | None = None
    defaults: dict = {}  # engine Params defaults (mode, k, theta, window, max_tokens ...)
    # Where the draft model runs: its own pool of replicas that scales on its own (the design's
    # composition, for GPUs), or inside the ingress process behind the same Drafter protocol
    # (no call per round: for a CPU node whose cores the processes share).
    drafter_placement: Literal["replica", "ingress"] = "replica"
    # Where the target runs: its own replica (TP ranks behind it; the design's composition, for
    # GPUs), or, with tp_size 1, inside the ingress process too: one process computes, with one
    # OpenMP team, and a round makes no call (for a CPU node, where each Ray process costs cores).
    target_placement: Literal["replica", "ingress"] = "replica"
    # Drafting calls per round: one per live drafter replica, at most this many (replica_pool.py)
    affinity_groups: int = Field(8, ge=1)
    # The drafter pool's autoscaling_config, replacing the deployment's (which scales on busy time
    # with replica_pool.BusyPolicy): e.g. {"min_replicas": 1, "max_replicas": 4, "policy": ...}
    drafter_autoscaling: dict | None = None
    # Serving units: ingress replicas, each pinned to a target replica of its own (no shared KV
    # slots), all sharing the drafter pool.
    units: int = Field(1, ge=1)
    # torch threads per target rank / of the drafter's process; None: the CPUs Ray gives it
    target_threads: int | None = None
    drafter_threads: int | None = None
    # the nice of the processes that compute (ingress, drafter replicas, target replicas, TP ranks):
    # ahead of Ray's control plane and other work on the node (deployments/parts/threads.py); None: leave
    serving_nice: int | None = Field(-10, ge=-20, le=19)
    tp_worker_options: dict = DEFAULT_TP_WORKER_OPTIONS  # Ray actor options of each TP rank (GPUs too)
    speculation_profile: dict | None = None  # k "auto"'s round cost model, as `fly-serve tune-k` writes it
    # the drafter drafts the next round while the target verifies this one (fly_serve/drafting/draft_ahead.py)
    draft_ahead: bool = False
    # Tokens each KV cache holds, all sequences together (the target's, on every TP rank alike, and
    # the drafter's); requests are admitted within it. None: max_batch sequences of 4096 tokens.
    kv_budget_tokens: int | None = Field(None, ge=KV_BLOCK_TOKENS)
    # Each model's own, where they must differ (an 8B drafter beside its target on a 24 GB GPU);
    # None: kv_budget_tokens. A drafter budget that does not fit fails the drafter's start.
    target_kv_budget_tokens: int | None = Field(None, ge=KV_BLOCK_TOKENS)
    drafter_kv_budget_tokens: int | None = Field(None, ge=KV_BLOCK_TOKENS)
    # Share the KV blocks of a common token prefix between requests (fly_serve/runtime/kv_cache.py)
    prefix_cache: bool = False
    # the models' runtime (fly_serve/loading/loading.py resolve_runtime): auto runs a GGUF model on
    # llama.cpp's kernels on a CPU, torch elsewhere
    runtime: Literal["auto", "torch", "llama.cpp"] = "auto"
    # llama.cpp's kernels chosen so that a position's logits do not depend on the forward's shape:
    # one text per greedy request however rounds and batches fall (fly_serve/runtime/llama_runner.py)
    reproducible: bool = False
    # the model drafter's loop (fly_serve/drafting/drafters.py draft_loop): auto runs the
    # fixed-shape loop on a GPU (fixed_loop.py) and the MLA loop on a CPU
    draft_loop: Literal["auto", "mla", "fixed"] = "auto"
    # Staying up (deployments/README.md, "Serving that stays up"):
    max_waiting: int = Field(DEFAULT_MAX_WAITING, ge=0)  # admitted beyond max_batch; past that, 503
    # one call from the ingress to the target or to a drafter replica (then it is cancelled)
    call_timeout_s: float = timeout(DEFAULT_CALL_TIMEOUT_S, "call_timeout_s", "remote_timeout_s")
    # an engine-loop round running longer means the loop is stuck: the ingress is unhealthy
    stuck_round_s: float = timeout(DEFAULT_STUCK_ROUND_S, "stuck_round_s", "round_timeout_s")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)  # a larger request body gets 413
    # A stream sends its text at most once every this many seconds (the first text and the end at
    # once): each chunk costs the service's processes work, taken from the forward where they share
    # its cores (deployments/ingress/stream_pacing.py). 0: a chunk every round. At most 5 s: a
    # longer silence reads as a stalled stream.
    stream_interval_s: float = Field(0.0, ge=0.0, le=5.0)
    body_timeout_s: float = timeout(DEFAULT_BODY_TIMEOUT_S)  # a body not all read by then gets 408
    # The target replica's own limits: one verify / release on every TP rank (past it the group is
    # rebuilt; keep it <= call_timeout_s so the target fails the call before its caller gives up),
    # a rank's answer to a health ping, and a TP group's start (load + join).
    rank_call_timeout_s: float = timeout(DEFAULT_RANK_CALL_TIMEOUT_S, "rank_call_timeout_s", "target_round_timeout_s")
    rank_ping_timeout_s: float = timeout(DEFAULT_RANK_PING_TIMEOUT_S, "rank_ping_timeout_s", "target_ping_timeout_s")
    tp_startup_timeout_s: float = timeout(
        DEFAULT_TP_STARTUP_TIMEOUT_S, "tp_startup_timeout_s", "target_startup_timeout_s"
    )
    # required as "Authorization: Bearer <key>" on /v1; $FLY_API_KEY wins. SecretStr: never printed
    api_key: SecretStr | None = None

    @model_validator(mode="after")
    def _target_in_ingress(self):
        if self.target_placement != "ingress":
            return self
        if self.tp_size != 1:
            raise ValueError(f"target_placement 'ingress' runs one rank: tp_size must be 1, got {self.tp_size}")
        if self.drafter_placement == "ingress" and self.drafter_threads not in (None, self.target_threads):
            raise ValueError(
                "drafter_threads: with the target and the drafter both in the ingress one OpenMP team runs"
                " both models; set target_threads"
            )
        return self

    @field_validator("drafters", mode="after")
    @classmethod
    def _drafter_specs(cls, v):
        """Each drafter's spec checked now (a bad one fails the build, naming it)."""
        for spec in (v or {}).values():
            DrafterSpec.coerce(spec)
        return v

    @field_validator(
        "tp_worker_options", "defaults", "speculation_profile", "drafter_autoscaling", "drafters", mode="before"
    )
    @classmethod
    def _json_from_cli(cls, v):
        """`serve run deployments.app:build key=value` passes strings: dicts come as JSON."""
        return json.loads(v) if isinstance(v, str) else v

    def engine_config(self) -> EngineConfig:
        """The engine's knobs: every EngineConfig field this model has, by the same name (a new
        engine knob is a field there and a field here, nothing else)."""
        knobs = {f.name: getattr(self, f.name) for f in fields(EngineConfig) if f.name in type(self).model_fields}
        if self.tiny:
            knobs.update(target="tiny:0", drafter="tiny:1")
        return EngineConfig(**{**knobs, "defaults": dict(self.defaults)})

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine_config().target
