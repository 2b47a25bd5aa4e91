"""Application builder: `serve run deployments.app:build target=... tp_size=2`, or a Serve config
YAML whose `import_path: deployments.app:build` and `args:` feed AppArgs (app_args.py). Building
binds the deployments only; weights load when the replicas start."""

from ray.serve import Application

from deployments.http.admission import serve_limits
from deployments.ingress.ingress import Ingress
from deployments.parts.drafter_replica import DrafterDeployment, deployment_name
from deployments.parts.target_replica import TargetDeployment
from deployments.profiles.app_args import AppArgs
from deployments.profiles.placement import TP_STRATEGY, tp_bundles
from deployments.routing.unit_router import router_config

__all__ = ["AppArgs", "build"]


def build(args: AppArgs | dict | None = None) -> Application:
    a = args if isinstance(args, AppArgs) else AppArgs(**(args or {}))
    config = a.engine_config()
    drafter_app = None
    if config.drafter_specs() and a.drafter_placement == "replica":
        drafter_app = bind_drafters(a)
    # Serve sheds with a plain-text 503 of its own: it is given room enough that ours sheds first.
    # The proxy routes by X-Session-Id to the unit holding the conversation (unit_router.py); set
    # with one unit too, so that one code path serves every profile.
    ingress = Ingress.options(
        **serve_limits(a.max_batch, a.max_waiting), num_replicas=a.units, request_router_config=router_config()
    )
    target_app = bind_target(a) if a.target_placement == "replica" else None  # else in the ingress
    return ingress.bind(target_app, drafter_app, args=a)


def bind_target(a: AppArgs):
    """One target replica per unit; with tp_size > 1 each in a placement group of one bundle per rank."""
    dep = TargetDeployment
    if a.tp_size > 1:
        replica_cpus = TargetDeployment.ray_actor_options.get("num_cpus", 1)  # Serve's default is 1
        bundles = tp_bundles(a.tp_size, a.tp_worker_options, replica_cpus)  # GPU ranks get GPU bundles
        dep = dep.options(placement_group_bundles=bundles, placement_group_strategy=TP_STRATEGY)
    if a.units > 1:
        dep = dep.options(autoscaling_config={"min_replicas": a.units, "max_replicas": a.units})
    return dep.bind(
        a.engine_config(),
        tp_size=a.tp_size,
        threads=a.target_threads,
        nice=a.serving_nice,
        worker_options=a.tp_worker_options,
        rank_call_timeout_s=a.rank_call_timeout_s,
        ping_timeout_s=a.rank_ping_timeout_s,
        startup_timeout_s=a.tp_startup_timeout_s,
    )


def bind_drafters(a: AppArgs):
    """One drafter pool per draft model (each its own deployment, scaled on its own busy time:
    FlyDrafter for the default, FlyDrafter-<name> for each other one): the default's alone where
    there is one, else {name: pool}."""
    names = list(a.engine_config().drafter_specs())
    pools = {name: bind_drafter(a, name, names[0]) for name in names}
    return pools[names[0]] if len(pools) == 1 else pools


def bind_drafter(a: AppArgs, name: str | None = None, default: str | None = None):
    """A drafter pool, with the KV budget and, when given, its own autoscaling config."""
    dep = DrafterDeployment
    if name is not None and name != default:
        dep = dep.options(name=deployment_name(name, default))
    if a.drafter_autoscaling:
        dep = dep.options(autoscaling_config=a.drafter_autoscaling)
    return dep.bind(a.engine_config(), threads=a.drafter_threads, nice=a.serving_nice, drafter=name)
