"""Where the Serve app's replicas go: the placement-group bundles of a tensor-parallel target
replica, and a dry rendering of a profile (what every deployment reserves at its largest scale)
that starts nothing and imports neither Ray nor the deployments.

A target replica with tp_size > 1 is one placement group of tp_size bundles, STRICT_PACK (one
node: the ranks talk over local gloo / NCCL). Bundle r holds rank r's Ray actor, so it carries
everything that actor asks for (CPU, GPU, memory, custom resources such as fly_target_gpu);
bundle 0 also holds the replica actor itself, which Serve always places there.

    python -m deployments.profiles.placement deployments/profiles/llama-70b.yaml [cluster.yaml]
"""

import json
import sys
from pathlib import Path

import yaml

TARGET_DEPLOYMENT = "FlyTarget"
DEFAULT_TP_WORKER_OPTIONS = {"num_cpus": 0.1}  # Ray actor options of each TP rank (AppArgs default)
TP_STRATEGY = "STRICT_PACK"
# An actor whose options give no num_cpus still needs 1 CPU to be placed (Ray: 1 CPU for its
# lifetime when other resources are given, else 1 CPU to schedule it); a Serve replica without
# num_cpus gets 1 (ReplicaConfig's default).
DEFAULT_ACTOR_CPUS = 1
RESOURCE_DIGITS = 4  # Ray accounts resources in units of 1e-4
_NOT_FOR_NODE_FIT = {"memory", "object_store_memory"}  # node types in cluster.yaml don't declare these


def _round(x: float) -> float | int:
    x = round(float(x), RESOURCE_DIGITS)
    return int(x) if x.is_integer() else x


def actor_resources(options: dict | None, default_cpus: float = DEFAULT_ACTOR_CPUS) -> dict:
    """The resources that Ray reserves for an actor created with `options` (num_cpus, num_gpus,
    memory, resources, accelerator_type, as ray._common.utils.resources_from_ray_options reads
    them), zero amounts left out. Non-resource options (max_restarts, runtime_env...) are ignored."""
    options = options or {}
    custom = dict(options.get("resources") or {})
    reserved = {"CPU", "GPU", "memory", "object_store_memory"} & set(custom)
    if reserved:
        raise ValueError(f"give {sorted(reserved)} as num_cpus / num_gpus / memory, not in `resources`: {options}")
    out = {"CPU": options["num_cpus"] if options.get("num_cpus") is not None else default_cpus}
    if options.get("num_gpus") is not None:
        out["GPU"] = options["num_gpus"]
    if options.get("memory") is not None:
        out["memory"] = int(options["memory"])
    out.update(custom)
    if options.get("accelerator_type") is not None:
        out[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    for name, amount in out.items():
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount < 0:
            raise ValueError(f"resource {name!r} must be a number >= 0, got {amount!r}")
    return {k: _round(v) for k, v in out.items() if v}


def add_resources(*demands: dict, times: float = 1) -> dict:
    total: dict = {}
    for d in demands:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v * times
    return {k: _round(v) for k, v in total.items()}


def tp_bundles(tp_size: int, worker: dict, replica_cpus: float) -> list[dict]:
    """Placement-group bundles of one TP replica: bundle r holds rank r, which is created with the
    Ray actor options `worker` (e.g. {"num_cpus": 2, "num_gpus": 1, "resources": {"fly_target_gpu": 1}}
    or {"num_cpus": 0.3}); bundle 0 also holds the replica actor's `replica_cpus`."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if replica_cpus < 0:
        raise ValueError(f"replica_cpus must be >= 0, got {replica_cpus!r}")
    rank = actor_resources(worker)
    bundles = [dict(rank) for _ in range(tp_size)]
    cpus = _round(rank.get("CPU", 0) + replica_cpus)
    bundles[0] = {**({"CPU": cpus} if cpus else {}), **{k: v for k, v in rank.items() if k != "CPU"}}
    for r, b in enumerate(bundles):
        if not b:  # Ray rejects empty / all-zero bundles
            raise ValueError(f"bundle {r} would be empty: each TP rank must ask for some resource, got {worker!r}")
    return bundles


def _replicas(dep: dict) -> tuple[dict, list[str]]:
    auto, n = dep.get("autoscaling_config"), dep.get("num_replicas")
    if n == "auto":  # Serve's default autoscaling for num_replicas="auto", overridden by autoscaling_config
        cfg = {"min_replicas": 1, "max_replicas": 100, **(auto or {})}
    elif auto:  # AutoscalingConfig's defaults: min 1, max 1
        cfg = {"min_replicas": 1, "max_replicas": 1, **auto}
    elif n is not None:
        return {"min": n, "max": n}, []
    else:
        return {"min": 1, "max": 1}, [
            "neither num_replicas nor autoscaling_config in the config: the code's value applies; rendered as 1 replica"
        ]
    return {"min": cfg["min_replicas"], "max": cfg["max_replicas"]}, []


def _covers(have: dict, need: dict, ignore=frozenset()) -> bool:
    return all(have.get(k, 0) >= v - 1e-9 for k, v in need.items() if k not in ignore)


def _short(have: dict, need: dict) -> dict:
    """What `have` lacks of `need`."""
    return {k: _round(v - have.get(k, 0)) for k, v in need.items() if have.get(k, 0) < v - 1e-9}


def _check_bundles(
    bundles: list[dict], strategy: str | None, replica: dict, tp_size: int, rank: dict | None
) -> list[str]:
    problems = []
    if not _covers(bundles[0], replica):
        problems.append(f"bundle 0 {bundles[0]} cannot hold the replica actor {replica}")
    if rank is None:
        return problems
    if len(bundles) != tp_size:
        problems.append(f"{len(bundles)} bundles for tp_size {tp_size}: one bundle per rank")
    if strategy != TP_STRATEGY:
        problems.append(f"strategy {strategy!r}: a TP group needs {TP_STRATEGY} (all ranks on one node)")
    for r, b in enumerate(bundles[:tp_size]):
        need = add_resources(rank, replica) if r == 0 else rank
        if not _covers(b, need):
            what = "rank 0 and the replica" if r == 0 else f"rank {r}"
            problems.append(f"bundle {r} {b} cannot hold {what} {need}: short of {_short(b, need)}")
    return problems


def _node_capacity(cluster: dict) -> dict:
    types = cluster["available_node_types"]
    head = cluster.get("head_node_type")
    return add_resources(
        *(
            add_resources(t.get("resources", {}), times=1 if name == head else t.get("max_workers", 0))
            for name, t in types.items()
        )
    )


def _fitting_node_types(per_bundle: list[dict], strategy: str | None, cluster: dict) -> list[str]:
    """Node types that can hold one replica: all its bundles on one node (STRICT_PACK, or the replica
    actor alone when it has no placement group), else each bundle on some node of the type."""
    types = cluster["available_node_types"]
    together = strategy in (None, TP_STRATEGY) or len(per_bundle) == 1
    needs = [add_resources(*per_bundle)] if together else per_bundle
    return [
        name
        for name, t in types.items()
        if all(_covers(t.get("resources", {}), need, _NOT_FOR_NODE_FIT) for need in needs)
    ]


def render_placement(config_path, cluster_path=None) -> dict:
    """What a Serve config YAML (deployments/profiles/*.yaml, import_path deployments.app:build) places,
    from the YAML and its app args alone, starting nothing. Per deployment: replicas (min/max),
    actor_options, bundles + strategy (those of the YAML; for the target with tp_size > 1 and no
    bundles in the YAML, those that the builder computes with tp_bundles), builder_bundles (the
    target: tp_bundles of tp_worker_options and the YAML's replica CPUs), per_replica and total (at
    max replicas) resources, and problems (bundles that cannot hold their ranks, a TP group not
    STRICT_PACK...). With cluster_path (cluster.yaml): node_types that can hold one replica, and
    the cluster's capacity at max workers. The config lists every deployment explicitly
    (tests/test_serve_configs.py checks it), so the YAML is the whole story."""
    config = yaml.safe_load(Path(config_path).read_text())
    cluster = yaml.safe_load(Path(cluster_path).read_text()) if cluster_path else None
    apps = {}
    for app in config.get("applications", []):
        args = app.get("args") or {}
        tp_size = args.get("tp_size", 1)
        worker = args.get("tp_worker_options", DEFAULT_TP_WORKER_OPTIONS)
        deployments = {}
        for dep in app.get("deployments", []):
            replicas, problems = _replicas(dep)
            actor_options = dep.get("ray_actor_options")
            if actor_options is None:
                problems.append("no ray_actor_options in the config: the code's apply; rendered as Serve's default")
            replica = actor_resources(actor_options)
            bundles = dep.get("placement_group_bundles")
            strategy = dep.get("placement_group_strategy")
            entry = {"replicas": replicas, "actor_options": actor_options or {}}
            rank = None
            if dep["name"] == TARGET_DEPLOYMENT and tp_size > 1:
                rank = actor_resources(worker)
                built = tp_bundles(tp_size, worker, replica.get("CPU", 0))
                entry.update(tp_size=tp_size, worker_options=worker, builder_bundles=built)
                if bundles is None:
                    bundles, strategy, source = built, TP_STRATEGY, "builder"
                else:
                    source = "config"
                entry["bundles_match_builder"] = len(bundles) == len(built) and all(
                    _covers(a, b) and _covers(b, a) for a, b in zip(bundles, built)
                )
            else:
                source = "config" if bundles is not None else None
            if bundles is not None:
                problems += _check_bundles(bundles, strategy, replica, tp_size, rank)
                per_bundle = [add_resources(b) for b in bundles]
            else:
                per_bundle = [replica]
            entry.update(
                bundles=bundles,
                strategy=strategy if bundles is not None else None,
                bundles_from=source,
                per_replica=add_resources(*per_bundle),
            )
            entry["total"] = add_resources(entry["per_replica"], times=replicas["max"])
            if cluster is not None:
                entry["node_types"] = _fitting_node_types(per_bundle, entry["strategy"], cluster)
                if not entry["node_types"]:
                    problems.append("no node type in the cluster can hold one replica")
            entry["problems"] = problems
            deployments[dep["name"]] = entry
        apps[app["name"]] = {
            "args": args,
            "deployments": deployments,
            "total": add_resources(*(d["total"] for d in deployments.values())),
        }
    out = {
        "config": str(config_path),
        "applications": apps,
        "total": add_resources(*(a["total"] for a in apps.values())),
    }
    if cluster is not None:
        capacity = _node_capacity(cluster)
        out["cluster"] = {
            "path": str(cluster_path),
            "capacity": capacity,
            "short": {k: v for k, v in _short(capacity, out["total"]).items() if k not in _NOT_FOR_NODE_FIT},
        }
    return out


def problems(rendered: dict) -> list[str]:
    """Every problem of a render_placement result, prefixed with app/deployment."""
    found = [
        f"{a}/{d}: {p}"
        for a, app in rendered["applications"].items()
        for d, dep in app["deployments"].items()
        for p in dep["problems"]
    ]
    if rendered.get("cluster", {}).get("short"):
        found.append(f"cluster: short of {rendered['cluster']['short']} at max scale")
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m deployments.profiles.placement SERVE_CONFIG.yaml [cluster.yaml]", file=sys.stderr)
        return 2
    rendered = render_placement(*argv)
    print(json.dumps(rendered, indent=2))
    bad = problems(rendered)
    for p in bad:
        print("problem:", p, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
