"""Application builder: `serve run deployments.app:build target=... tp_size=2`, or a Serve config
YAML whose `import_path: deployments.app:build` and `args:` feed AppArgs. Building binds the
deployments only; weights load when the replicas start."""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from ray.serve import Application

from fly_serve.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

from .drafter_replica import DrafterDeployment
from .ingress import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, DEFAULT_ROUND_TIMEOUT_S, Ingress, serve_limits
from .lookup_replica import LookupDeployment
from .placement import DEFAULT_TP_WORKER_OPTIONS, TP_STRATEGY, tp_bundles
from .remote_parts import DEFAULT_TIMEOUT_S
from .target_replica import PING_TIMEOUT_S, ROUND_TIMEOUT_S, STARTUP_TIMEOUT_S, TargetDeployment

KV_BLOCK_TOKENS = 16  # the KV cache's block size: a smaller budget holds no block


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = DEFAULT_TARGET
    drafter: str | None = DEFAULT_DRAFTER  # None: no draft model (ar and pld modes only)
    tiny: bool = False  # tiny random models ("tiny:0" target, "tiny:1" drafter), for tests
    dtype: str = "auto"
    drafter_precision: str = "int8"
    tp_size: int = 1
    max_batch: int = 8
    max_model_len: int = 4096
    served_model_name: str | None = None
    defaults: dict = {}  # engine Params defaults (mode, k, theta, window, max_tokens ...)
    # Drafting calls per round: one per live drafter replica, at most this many (replica_pool.py)
    affinity_groups: int = Field(8, ge=1)
    # The drafter pool's autoscaling_config, replacing the deployment's (which scales on busy time
    # with replica_pool.BusyPolicy): e.g. {"min_replicas": 1, "max_replicas": 4, "policy": ...}
    drafter_autoscaling: dict | None = None
    # Serving units: ingress replicas, each pinned to a target replica of its own (no shared KV
    # slots), all sharing the drafter pool.
    units: int = Field(1, ge=1)
    pld: Literal["ingress", "deployment"] = "ingress"  # where pld mode's prompt lookup runs
    target_threads: int | None = None  # torch threads per target rank
    drafter_threads: int | None = None
    tp_worker_options: dict = DEFAULT_TP_WORKER_OPTIONS  # Ray actor options of each TP rank (GPUs too)
    speculation_profile: dict | None = None  # k "auto"'s round cost model, as `fly-serve tune-k` writes it
    # Tokens each KV cache holds, all sequences together (the target's, on every TP rank alike, and
    # the drafter's); requests are admitted within it. None: max_batch sequences of 4096 tokens.
    kv_budget_tokens: int | None = Field(None, ge=KV_BLOCK_TOKENS)
    # Each model's own, where they must differ (an 8B drafter beside its target on a 24 GB GPU);
    # None: kv_budget_tokens. A drafter budget that does not fit fails the drafter's start.
    target_kv_budget_tokens: int | None = Field(None, ge=KV_BLOCK_TOKENS)
    drafter_kv_budget_tokens: int | None = Field(None, ge=KV_BLOCK_TOKENS)
    # Staying up (deployments/README.md, "Serving that stays up"):
    max_waiting: int = Field(DEFAULT_MAX_WAITING, ge=0)  # admitted beyond max_batch; past that, 503
    remote_timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0)  # one call to the target / drafter / lookup
    round_timeout_s: float = Field(DEFAULT_ROUND_TIMEOUT_S, gt=0)  # a round running longer: unhealthy
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)  # a larger request body gets 413
    # The target replica's own limits: one verify / release on every TP rank (past it the group is
    # rebuilt; keep it <= remote_timeout_s so the target fails the call before its caller gives
    # up), a rank's answer to a health ping, and a TP group's start (load + join).
    target_round_timeout_s: float = Field(ROUND_TIMEOUT_S, gt=0)
    target_ping_timeout_s: float = Field(PING_TIMEOUT_S, gt=0)
    target_startup_timeout_s: float = Field(STARTUP_TIMEOUT_S, gt=0)
    # required as "Authorization: Bearer <key>" on /v1; $FLY_API_KEY wins. SecretStr: never printed
    api_key: SecretStr | None = None

    @field_validator("tp_worker_options", "defaults", "speculation_profile", "drafter_autoscaling", mode="before")
    @classmethod
    def _json_from_cli(cls, v):
        """`serve run deployments.app:build key=value` passes strings: dicts come as JSON."""
        return json.loads(v) if isinstance(v, str) else v


def build(args: AppArgs | dict | None = None) -> Application:
    a = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    target, drafter = ("tiny:0", "tiny:1") if a.tiny else (a.target, a.drafter)
    target_dep = TargetDeployment
    if a.tp_size > 1:
        replica_cpus = TargetDeployment.ray_actor_options.get("num_cpus", 1)  # Serve's default is 1
        bundles = tp_bundles(a.tp_size, a.tp_worker_options, replica_cpus)  # GPU ranks get GPU bundles
        target_dep = TargetDeployment.options(placement_group_bundles=bundles, placement_group_strategy=TP_STRATEGY)
    if a.units > 1:
        target_dep = target_dep.options(autoscaling_config={"min_replicas": a.units, "max_replicas": a.units})
    target_app = target_dep.bind(
        target,
        a.dtype,
        a.tp_size,
        a.max_batch,
        a.target_threads,
        a.tp_worker_options,
        round_timeout_s=a.target_round_timeout_s,
        startup_timeout_s=a.target_startup_timeout_s,
        ping_timeout_s=a.target_ping_timeout_s,
        kv_budget_tokens=a.target_kv_budget_tokens or a.kv_budget_tokens,
    )
    drafter_app = bind_drafter(drafter, a) if drafter else None
    lookup_app = LookupDeployment.bind() if a.pld == "deployment" else None
    # Serve sheds with a plain-text 503 of its own: it is given room enough that ours sheds first.
    ingress = Ingress.options(**serve_limits(a.max_batch, a.max_waiting), num_replicas=a.units)
    return ingress.bind(
        target_app,
        drafter_app,
        lookup_app,
        model=target,
        drafter=drafter,
        served_model_name=a.served_model_name,
        max_batch=a.max_batch,
        max_model_len=a.max_model_len,
        defaults=a.defaults,
        affinity_groups=a.affinity_groups,
        speculation_profile=a.speculation_profile,
        max_waiting=a.max_waiting,
        remote_timeout_s=a.remote_timeout_s,
        round_timeout_s=a.round_timeout_s,
        max_body_bytes=a.max_body_bytes,
        api_key=a.api_key.get_secret_value() if a.api_key else None,
    )


def bind_drafter(drafter: str, a: AppArgs):
    """The drafter pool, with the KV budget and, when given, its own autoscaling config."""
    dep = DrafterDeployment
    if a.drafter_autoscaling:
        dep = dep.options(autoscaling_config=a.drafter_autoscaling)
    budget = a.drafter_kv_budget_tokens or a.kv_budget_tokens
    return dep.bind(drafter, a.drafter_precision, a.max_batch, a.drafter_threads, kv_budget_tokens=budget)
