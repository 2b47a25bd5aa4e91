"""Placement-group bundles of a TP target replica (deployments/profiles/placement.py) and the dry rendering
of the profiles: GPU ranks get GPU bundles, the hand-written bundles of the YAMLs agree with the
builder, and the GPU profiles fit the node types of cluster.yaml. Nothing here starts Ray."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from deployments.profiles.placement import actor_resources, main, problems, render_placement, tp_bundles

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS = ROOT / "deployments" / "profiles"
CLUSTER = ROOT / "cluster.yaml"
GPU_WORKER = {"num_cpus": 2, "num_gpus": 1, "resources": {"fly_target_gpu": 1}}
PROFILES = [
    "cpu-default.yaml",
    "cpu-target-replica.yaml",
    "cpu-tp2.yaml",
    "llama-70b.yaml",
    "llama-405b.yaml",
    "cpu-multinode.yaml",
    "cpu-multinode-ha.yaml",
]
TP_PROFILES = PROFILES[2:]  # tp_size > 1: their bundles are in the YAML
LOCAL_CLUSTER = ROOT / "cluster-local.yaml"  # the node types of tests/test_multinode.py's cluster


def load(name):
    [app] = yaml.safe_load((DEPLOYMENTS / name).read_text())["applications"]
    return app, {d["name"]: d for d in app["deployments"]}


def test_gpu_worker_options_give_gpu_bundles():
    bundles = tp_bundles(4, GPU_WORKER, replica_cpus=1)
    assert len(bundles) == 4
    assert all(b["GPU"] == 1 and b["fly_target_gpu"] == 1 for b in bundles)
    assert bundles[0]["CPU"] == 3  # rank 0 and the replica actor
    assert [b["CPU"] for b in bundles[1:]] == [2, 2, 2]
    assert bundles == [{"CPU": 3, "GPU": 1, "fly_target_gpu": 1}] + [{"CPU": 2, "GPU": 1, "fly_target_gpu": 1}] * 3


def test_cpu_worker_options_give_cpu_bundles():
    assert tp_bundles(2, {"num_cpus": 0.3}, replica_cpus=0.1) == [{"CPU": 0.4}, {"CPU": 0.3}]
    assert tp_bundles(3, {"num_cpus": 0.1}, replica_cpus=0.2) == [{"CPU": 0.3}, {"CPU": 0.1}, {"CPU": 0.1}]


def test_bundles_are_separate_dicts():
    bundles = tp_bundles(3, GPU_WORKER, 1)
    bundles[1]["GPU"] = 7
    assert bundles[2]["GPU"] == 1 and GPU_WORKER == {"num_cpus": 2, "num_gpus": 1, "resources": {"fly_target_gpu": 1}}


def test_rank_without_num_cpus_still_gets_the_cpu_ray_needs_to_place_it():
    assert tp_bundles(2, {"num_gpus": 1}, 0.5) == [{"CPU": 1.5, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    assert tp_bundles(2, {}, 0) == [{"CPU": 1}, {"CPU": 1}]


def test_zero_cpu_gpu_rank_and_extra_options():
    worker = {
        "num_cpus": 0,
        "num_gpus": 0.5,
        "memory": 2**30,
        "accelerator_type": "A100",
        "max_restarts": 2,
        "resources": {"fly_target_gpu": 0.5},
    }
    b0, b1 = tp_bundles(2, worker, 0.2)
    assert b1 == {"GPU": 0.5, "memory": 2**30, "fly_target_gpu": 0.5, "accelerator_type:A100": 0.001}
    assert b0 == {"CPU": 0.2, **b1}


@pytest.mark.parametrize(
    "tp_size, worker, replica_cpus",
    [
        (0, GPU_WORKER, 1),
        (2.0, GPU_WORKER, 1),
        (2, {"num_cpus": 1, "resources": {"GPU": 1}}, 1),  # GPU belongs in num_gpus
        (2, {"num_cpus": -1}, 1),
        (2, GPU_WORKER, -1),
        (2, {"num_cpus": 0}, 0.2),  # bundle 1 would be empty: Ray rejects it
    ],
)
def test_bad_input_is_refused(tp_size, worker, replica_cpus):
    with pytest.raises(ValueError):
        tp_bundles(tp_size, worker, replica_cpus)


@pytest.mark.parametrize(
    "options",
    [
        {"num_cpus": 2, "num_gpus": 1, "resources": {"fly_target_gpu": 1}},
        {"num_cpus": 0.3},
        {"num_cpus": 1, "num_gpus": 0.5, "memory": 1e9, "accelerator_type": "L4", "resources": {"x": 2}},
    ],
)
def test_actor_resources_agrees_with_ray(options):
    utils = pytest.importorskip("ray._common.utils")
    assert actor_resources(options) == {k: v for k, v in utils.resources_from_ray_options(options).items() if v}


@pytest.mark.parametrize("worker, replica", [(GPU_WORKER, {"num_cpus": 1}), ({"num_cpus": 0.3}, {"num_cpus": 0.1})])
def test_ray_and_serve_accept_the_bundles(worker, replica):
    """Ray's placement-group validation and Serve's (the replica actor must fit bundle 0), both
    without a cluster."""
    from ray import serve
    from ray.util.placement_group import validate_placement_group

    bundles = tp_bundles(4, worker, replica["num_cpus"])
    validate_placement_group(bundles, "STRICT_PACK")

    class Replica:
        pass

    serve.deployment(
        ray_actor_options=replica, placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK"
    )(Replica)


@pytest.mark.parametrize("name", TP_PROFILES)
def test_yaml_bundles_equal_what_the_builder_computes(name):
    app, deps = load(name)
    target, args = deps["FlyTarget"], app["args"]
    built = tp_bundles(args["tp_size"], args["tp_worker_options"], target["ray_actor_options"]["num_cpus"])
    assert target["placement_group_bundles"] == built
    rendered = render_placement(DEPLOYMENTS / name)["applications"][app["name"]]["deployments"]["FlyTarget"]
    assert rendered["builder_bundles"] == built and rendered["bundles_match_builder"]
    assert rendered["bundles_from"] == "config"


@pytest.mark.parametrize("name", PROFILES)
def test_profiles_render_without_problems(name):
    cluster = CLUSTER if name.startswith("llama") or name.startswith("cpu-multinode") else None
    assert problems(render_placement(DEPLOYMENTS / name, cluster)) == []


@pytest.mark.parametrize(
    "cluster, target", [(LOCAL_CLUSTER, ["target_2gpu"]), (CLUSTER, ["target_4gpu", "target_8gpu"])]
)
def test_cpu_multinode_puts_each_part_on_a_node_type_of_its_own(cluster, target):
    """By node resources alone: the ingress on the head, the TP group on target nodes, the
    drafters on drafter nodes, in the local test cluster and in cluster.yaml alike."""
    rendered = render_placement(DEPLOYMENTS / "cpu-multinode.yaml", cluster)
    types = {name: d["node_types"] for name, d in rendered["applications"]["fly"]["deployments"].items()}
    assert types == {"FlyIngress": ["head"], "FlyTarget": target, "FlyDrafter": ["drafter_1gpu"]}
    assert problems(rendered) == []


@pytest.mark.parametrize(
    "cluster, target", [(LOCAL_CLUSTER, ["target_2gpu"]), (CLUSTER, ["target_4gpu", "target_8gpu"])]
)
def test_cpu_multinode_ha_puts_no_replica_on_the_head(cluster, target):
    """The profile that survives its head: the ingress on a frontend node, nothing the head could
    hold (its loss takes only Ray's and Serve's own processes), proxies on every node."""
    rendered = render_placement(DEPLOYMENTS / "cpu-multinode-ha.yaml", cluster)
    types = {name: d["node_types"] for name, d in rendered["applications"]["fly"]["deployments"].items()}
    assert types == {"FlyIngress": ["frontend"], "FlyTarget": target, "FlyDrafter": ["drafter_1gpu"]}
    assert problems(rendered) == []
    assert yaml.safe_load((DEPLOYMENTS / "cpu-multinode-ha.yaml").read_text())["proxy_location"] == "EveryNode"


def test_render_llama_70b():
    app, deps = load("llama-70b.yaml")
    rendered = render_placement(DEPLOYMENTS / "llama-70b.yaml", CLUSTER)
    fly = rendered["applications"][app["name"]]["deployments"]
    target, drafter = fly["FlyTarget"], fly["FlyDrafter"]
    target_max = deps["FlyTarget"]["autoscaling_config"]["max_replicas"]
    drafter_max = deps["FlyDrafter"]["autoscaling_config"]["max_replicas"]

    assert target["replicas"] == {"min": deps["FlyTarget"]["autoscaling_config"]["min_replicas"], "max": target_max}
    assert target["strategy"] == "STRICT_PACK" and target["tp_size"] == 4
    assert len(target["bundles"]) == 4 and all(b["GPU"] == 1 for b in target["bundles"])
    assert target["actor_options"] == deps["FlyTarget"]["ray_actor_options"]
    assert target["per_replica"] == {"CPU": 9, "GPU": 4, "fly_target_gpu": 4}
    assert target["total"]["GPU"] == 4 * target_max == target["total"]["fly_target_gpu"]
    assert drafter["bundles"] is None and drafter["replicas"]["max"] == drafter_max
    assert drafter["total"]["GPU"] == drafter_max == drafter["total"]["fly_drafter_gpu"]
    assert rendered["total"]["GPU"] == 4 * target_max + drafter_max
    # a target replica fits a 4- or 8-GPU node, never the head or a drafter node; drafters only theirs
    assert target["node_types"] == ["target_4gpu", "target_8gpu"]
    assert drafter["node_types"] == ["drafter_1gpu"]
    assert rendered["cluster"]["short"] == {}


def test_render_llama_405b_needs_the_8gpu_node():
    rendered = render_placement(DEPLOYMENTS / "llama-405b.yaml", CLUSTER)
    target = rendered["applications"]["fly"]["deployments"]["FlyTarget"]
    assert len(target["bundles"]) == 8 and target["per_replica"]["GPU"] == 8
    assert target["node_types"] == ["target_8gpu"]


def test_cpu_default_fits_two_cores():
    rendered = render_placement(DEPLOYMENTS / "cpu-default.yaml")
    assert rendered["total"]["CPU"] <= 2
    assert "GPU" not in rendered["total"]
    assert set(rendered["applications"]["fly"]["deployments"]) == {"FlyIngress"}  # the target is in it


def test_cpu_target_replica_fits_two_cores():
    rendered = render_placement(DEPLOYMENTS / "cpu-target-replica.yaml")
    assert rendered["total"]["CPU"] <= 2
    assert "GPU" not in rendered["total"]
    assert rendered["applications"]["fly"]["deployments"]["FlyTarget"]["bundles"] is None  # TP=1: no group


def test_cpu_tp2_fits_two_cores():
    rendered = render_placement(DEPLOYMENTS / "cpu-tp2.yaml")
    assert rendered["total"]["CPU"] <= 2
    assert "GPU" not in rendered["total"]
    target = rendered["applications"]["fly"]["deployments"]["FlyTarget"]
    assert target["bundles"] == [{"CPU": 0.4}, {"CPU": 0.3}]


def fly_target(rendered):
    return rendered["applications"]["fly"]["deployments"]["FlyTarget"]


def write_variant(tmp_path, name, edit):
    config = yaml.safe_load((DEPLOYMENTS / name).read_text())
    edit({d["name"]: d for d in config["applications"][0]["deployments"]}, config["applications"][0]["args"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_without_bundles_in_the_yaml_the_builder_bundles_apply(tmp_path):
    def edit(deps, args):
        del deps["FlyTarget"]["placement_group_bundles"], deps["FlyTarget"]["placement_group_strategy"]

    target = fly_target(render_placement(write_variant(tmp_path, "llama-70b.yaml", edit)))
    assert target["bundles_from"] == "builder" and target["strategy"] == "STRICT_PACK"
    assert target["bundles"] == tp_bundles(4, GPU_WORKER, 1) and target["problems"] == []


def test_cpu_only_bundles_for_gpu_ranks_are_reported(tmp_path):
    """What the old builder produced for the GPU profiles: CPU-only bundles, where no GPU rank fits."""

    def edit(deps, args):
        deps["FlyTarget"]["placement_group_bundles"] = [{"CPU": 3}] + [{"CPU": 2}] * 3

    rendered = render_placement(write_variant(tmp_path, "llama-70b.yaml", edit), CLUSTER)
    target = rendered["applications"]["fly"]["deployments"]["FlyTarget"]
    assert not target["bundles_match_builder"]
    assert len(target["problems"]) == 4 and all("short of" in p and "GPU" in p for p in target["problems"])
    assert len(problems(rendered)) == 4


def test_a_tp_group_across_nodes_and_a_missing_rank_are_reported(tmp_path):
    def edit(deps, args):
        deps["FlyTarget"]["placement_group_strategy"] = "PACK"
        deps["FlyTarget"]["placement_group_bundles"] = deps["FlyTarget"]["placement_group_bundles"][:3]

    target = fly_target(render_placement(write_variant(tmp_path, "llama-70b.yaml", edit)))
    assert any("3 bundles for tp_size 4" in p for p in target["problems"])
    assert any("STRICT_PACK" in p for p in target["problems"])


def test_cluster_too_small_is_reported(tmp_path):
    cluster = yaml.safe_load(CLUSTER.read_text())
    small = copy.deepcopy(cluster)
    small["available_node_types"]["drafter_1gpu"]["max_workers"] = 2
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(small))
    rendered = render_placement(DEPLOYMENTS / "llama-70b.yaml", path)
    assert rendered["cluster"]["short"] == {"fly_drafter_gpu": 2}  # 4 drafter replicas, 2 nodes
    assert problems(rendered) == ["cluster: short of {'fly_drafter_gpu': 2} at max scale"]


def test_cli(capsys):
    assert main([str(DEPLOYMENTS / "llama-70b.yaml"), str(CLUSTER)]) == 0
    assert '"FlyTarget"' in capsys.readouterr().out
    assert main([]) == 2


def test_app_builder_places_gpu_ranks_from_the_command_line_style_args():
    """`serve run deployments.app:build tp_size=4 tp_worker_options='{...}'` (strings, as Serve's
    CLI passes them) builds GPU bundles for the target's ranks."""
    from ray.serve._private.build_app import build_app

    from deployments.app import build

    worker = {"num_cpus": 2, "num_gpus": 1, "resources": {"fly_target_gpu": 1}}
    app = build({"tp_size": "4", "tp_worker_options": json.dumps(worker), "drafter": None})
    [target] = [d for d in build_app(app, name="fly").deployments if d.name == "FlyTarget"]
    bundles = target._replica_config.placement_group_bundles
    assert len(bundles) == 4 and all(b["GPU"] == 1 and b["fly_target_gpu"] == 1 for b in bundles)
    assert target._replica_config.placement_group_strategy == "STRICT_PACK"
