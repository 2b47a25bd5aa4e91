"""Every Serve config in deployments/profiles/ loads and builds its application (no deploy, no weights),
and cluster.yaml is valid against Ray's own cluster-launcher schema."""

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from pydantic import ValidationError
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs, build
from deployments.http.admission import serve_limits

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.serve
CONFIGS = sorted((ROOT / "deployments" / "profiles").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"cpu-default.yaml", "llama-70b.yaml", "llama-405b.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_config_builds(path):
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for app_config in config.applications:
        app = call_user_app_builder_with_args_if_necessary(import_attr(app_config.import_path), app_config.args)
        built = {d.name: d for d in build_app(app, name=app_config.name).deployments}
        configured = {d.name: d for d in app_config.deployments}
        # every deployment is configured explicitly, and nothing configured is missing
        assert set(configured) == set(built)
        for d in configured.values():
            assert d.autoscaling_config and d.ray_actor_options, d.name
        check_ingress_sheds_first(app_config.args, built["FlyIngress"], configured["FlyIngress"])
        tp = app_config.args.get("tp_size", 1)
        if tp > 1:
            target = configured["FlyTarget"]
            assert len(target.placement_group_bundles) == tp
            assert target.placement_group_strategy == "STRICT_PACK"
            # the replica itself sits in bundle 0, beside rank 0
            worker = app_config.args["tp_worker_options"]
            replica_cpus = target.ray_actor_options.num_cpus
            assert target.placement_group_bundles[0]["CPU"] >= worker["num_cpus"] + replica_cpus
            assert all(b.get("GPU", 0) >= worker.get("num_gpus", 0) for b in target.placement_group_bundles)


def check_ingress_sheds_first(args: dict, built, configured) -> None:
    """Serve's own limits on the ingress (a plain-text 503) stay above ours (the OpenAI-format
    503), from the builder and from whatever the profile sets."""
    a = AppArgs(**args)
    ours = a.max_batch + a.max_waiting
    assert built.max_ongoing_requests == serve_limits(a.max_batch, a.max_waiting)["max_ongoing_requests"] > ours
    assert built.max_queued_requests == -1
    set_here = configured.model_dump(exclude_unset=True)
    assert set_here.get("max_ongoing_requests", ours + 1) > ours
    assert set_here.get("max_queued_requests", -1) == -1


def test_profile_keys_reach_the_target_and_drafter():
    app = build({"tiny": True, "kv_budget_tokens": 256, "rank_call_timeout_s": 7, "rank_ping_timeout_s": 3})
    built = {d.name: d for d in build_app(app, name="fly").deployments}
    target = built["FlyTarget"]
    assert target.init_args[0].kv_budget_tokens == built["FlyDrafter"].init_args[0].kv_budget_tokens == 256
    assert (target.init_kwargs["rank_call_timeout_s"], target.init_kwargs["ping_timeout_s"]) == (7, 3)
    assert target.init_kwargs["startup_timeout_s"] == AppArgs().tp_startup_timeout_s


def test_a_target_in_the_ingress_is_one_rank_and_no_deployment():
    app = build({"tiny": True, "target_placement": "ingress", "drafter_placement": "ingress"})
    assert [d.name for d in build_app(app, name="fly").deployments] == ["FlyIngress"]
    app = build({"tiny": True, "target_placement": "ingress"})  # the drafter pool stays a deployment
    assert {d.name for d in build_app(app, name="fly").deployments} == {"FlyIngress", "FlyDrafter"}
    with pytest.raises(ValidationError, match="target_placement 'ingress' runs one rank: tp_size must be 1, got 2"):
        AppArgs(target_placement="ingress", tp_size=2)
    both = {"target_placement": "ingress", "drafter_placement": "ingress", "target_threads": 2}
    with pytest.raises(ValidationError, match="drafter_threads: with the target and the drafter both in the ingress"):
        AppArgs(**both, drafter_threads=1)
    assert AppArgs(**both, drafter_threads=2).drafter_threads == 2  # the same count says nothing new


def test_old_timeout_names_are_still_accepted():
    a = AppArgs(remote_timeout_s=5, round_timeout_s=6, target_round_timeout_s=7, target_ping_timeout_s=8)
    assert (a.call_timeout_s, a.stuck_round_s, a.rank_call_timeout_s, a.rank_ping_timeout_s) == (5, 6, 7, 8)


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_budget_tokens", 8),  # less than one 16-token block
        ("kv_budget_tokens", -1),
        ("rank_call_timeout_s", 0),
        ("rank_ping_timeout_s", -1),
        ("tp_startup_timeout_s", 0),
        ("call_timeout_s", 0),
        ("max_waiting", -1),
        ("stream_interval_s", -0.1),
        ("stream_interval_s", 60),  # a stream silent that long reads as stalled
    ],
)
def test_bad_profile_values_name_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        AppArgs(**{field: value})
    assert e.value.errors()[0]["loc"] == (field,)


def test_cpu_default_fits_two_cores():
    config = yaml.safe_load((ROOT / "deployments" / "profiles" / "cpu-default.yaml").read_text())
    [app] = config["applications"]
    total = 0.0
    for d in app["deployments"]:
        bundles = d.get("placement_group_bundles")
        per_replica = sum(b["CPU"] for b in bundles) if bundles else d["ray_actor_options"]["num_cpus"]
        total += per_replica * d["autoscaling_config"]["max_replicas"]
    assert total <= 2


def test_cluster_yaml_is_valid_for_the_ray_launcher():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    assert any(t["resources"].get("GPU") == 4 for t in types.values())
    assert any(t["resources"].get("GPU") == 1 for t in types.values())
    assert any("pip install" in c for c in cluster["setup_commands"])
