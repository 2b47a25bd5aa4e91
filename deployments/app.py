"""Application builder: `serve run deployments.app:build target=... tp_size=2`, or a Serve config
YAML whose `import_path: deployments.app:build` and `args:` feed AppArgs. Building binds the
deployments only; weights load when the replicas start."""

from typing import Literal

from pydantic import BaseModel, ConfigDict
from ray.serve import Application

from fly_serve.weights import DEFAULT_DRAFTER, DEFAULT_TARGET

from .drafter_replica import DrafterDeployment
from .ingress import Ingress
from .lookup_replica import LookupDeployment
from .target_replica import TargetDeployment


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = DEFAULT_TARGET
    drafter: str | None = DEFAULT_DRAFTER  # None: no draft model (ar and pld modes only)
    tiny: bool = False  # tiny random models ("tiny:0" target, "tiny:1" drafter), for tests
    dtype: str = "bf16"
    drafter_precision: str = "int8"
    tp_size: int = 1
    max_batch: int = 8
    max_model_len: int = 4096
    served_model_name: str | None = None
    defaults: dict = {}  # engine Params defaults (mode, k, theta, window, max_tokens ...)
    affinity_groups: int = 1  # drafter session-affinity groups (one drafter call per group)
    pld: Literal["ingress", "deployment"] = "ingress"  # where pld mode's prompt lookup runs
    target_threads: int | None = None  # torch threads per target rank
    drafter_threads: int | None = None
    tp_worker_options: dict = {"num_cpus": 0.1}  # Ray actor options of each TP rank


def tp_bundles(tp_size: int, worker_cpus: float, replica_cpus: float) -> list[dict]:
    """Bundle r holds rank r; bundle 0 also holds the replica actor itself."""
    return [{"CPU": worker_cpus + (replica_cpus if r == 0 else 0)} for r in range(tp_size)]


def build(args: AppArgs | dict | None = None) -> Application:
    a = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    target, drafter = ("tiny:0", "tiny:1") if a.tiny else (a.target, a.drafter)
    target_dep = TargetDeployment
    if a.tp_size > 1:
        replica_cpus = TargetDeployment.ray_actor_options.get("num_cpus", 0.2)
        bundles = tp_bundles(a.tp_size, a.tp_worker_options.get("num_cpus", 0.1), replica_cpus)
        target_dep = TargetDeployment.options(placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    target_app = target_dep.bind(target, a.dtype, a.tp_size, a.max_batch, a.target_threads, a.tp_worker_options)
    drafter_app = (
        DrafterDeployment.bind(drafter, a.drafter_precision, a.max_batch, a.drafter_threads) if drafter else None
    )
    lookup_app = LookupDeployment.bind() if a.pld == "deployment" else None
    return Ingress.bind(
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
    )
