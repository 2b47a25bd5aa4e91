"""The app on a multi-node Ray cluster (tiny models, every node a raylet of its own on 127.0.0.1:
deployments/local_cluster.py), deployed from deployments/profiles/cpu-multinode.yaml as an operator would:
placement is the profile's (read back from Ray: the node of each replica and TP rank), outputs are
the in-process engine's, a drafter node that joins gets a replica under load and the pool shrinks
back when idle, a drafter node killed mid-generation fails no request, a target node killed gives
its in-flight requests a clean error and /healthz 503 until a new target node is up, then the app
answers again without a restart. Each test prints what it measured (times to scale, to recover).

Only processes this test started are killed, by pid (a node's raylet: LocalCluster.kill); the
fixture stops every node. The profile's placement is unchanged; the test overrides only timeouts
and the drafter pool's autoscaling (eager: a tiny drafter is never busy for long)."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from serve_fixture import ROOT, per_replica, running

from deployments.launch import wait_ready
from deployments.local_cluster import PROFILE, LocalCluster
from fly_serve.build import build_engine
from fly_serve.runtime.tp import free_port
from loadtest.client import InFlight, complete, stats
from loadtest.waits import HealthWatch, probe_until, until, wait_generating, wait_status

pytestmark = pytest.mark.serve

NODE_TYPES = ROOT / "cluster-local.yaml"
HEAD, TARGET, DRAFTER = "head", "target_2gpu", "drafter_1gpu"
CALL_TIMEOUT_S = 10.0  # a call to a replica on a dead node gives up within this
TEST_ARGS = {
    "max_batch": 4,
    "defaults": {"max_tokens": 24},
    "call_timeout_s": CALL_TIMEOUT_S,
    "rank_call_timeout_s": CALL_TIMEOUT_S,
    "kv_budget_tokens": 4096,
}
EAGER_POOL = {
    "min_replicas": 1,
    "max_replicas": 2,
    "upscale_delay_s": 0.5,
    "downscale_delay_s": 15,  # longer than the waves that read both replicas drafting
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "policy": {"policy_function": "deployments.routing.replica_pool:BusyPolicy", "policy_kwargs": {"target": 0.01}},
}
FLY = {"mode": "fly", "k": 4, "theta": 0.3, "window": 2}  # loose acceptance: the gate reads the target's entropy
PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "1, 2, 3, 4, 5,", "hello hello hello"]
LONG_TOKENS = 600  # in flight when a node dies (the tiny model's context is 1,024)
READY_S, SCALE_S, RECOVERY_S = 240.0, 120.0, 180.0


def report(title: str, summary: dict) -> None:
    print(f"\n[multinode] {title}: {json.dumps(summary, default=str)}", flush=True)


@pytest.fixture(scope="module")
def cluster():
    """A head, a target node and a drafter node, the app deployed; every node stopped after."""
    c = LocalCluster(NODE_TYPES)
    try:
        t0 = time.monotonic()
        c.start()
        url = c.deploy(
            PROFILE,
            free_port(),
            tiny=True,
            args=TEST_ARGS,
            deployments={"FlyDrafter": {"autoscaling_config": EAGER_POOL}},
        )
        assert wait_ready(url, timeout_s=READY_S), "the app did not become ready"
        report("cluster up, app ready", {"s": round(time.monotonic() - t0, 1), "nodes": [n.type for n in c.nodes]})
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def reference():
    engine = build_engine("tiny:0", "tiny:1", max_model_len=1024)
    return {p: engine.generate([p], [{"max_tokens": 24, **FLY}])[0].text for p in PROMPTS}


def generate(url: str, prompt: str) -> str:
    r = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "fly": FLY}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wave(url: str, n: int = 8) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: (PROMPTS[i % 4], generate(url, PROMPTS[i % 4])), range(n)))


def forwards_by_replica() -> dict[int, int]:
    """Each running drafter replica's model forwards since its start, by its pid."""
    n = running("FlyDrafter")
    reports = per_replica("FlyDrafter", "cache_report", n)
    return dict(zip(per_replica("FlyDrafter", "pid", n), (r["forwards"] for r in reports)))


# ---- 1, 2: placement is what the profile says, outputs are the engine's
def test_each_replica_and_rank_runs_on_the_node_type_its_profile_names(cluster, reference):
    # (that the profile names one node type each is test_placement's, which starts nothing)
    for prompt in PROMPTS:
        assert generate(cluster.url, prompt) == reference[prompt]
    placed = {name: cluster.where(name) for name in ("FlyIngress", "FlyTarget", "TPWorker", "FlyDrafter")}
    report("placement", {k: [(p.node_type, p.node_id[:8], p.pid) for p in v] for k, v in placed.items()})
    assert [p.node_type for p in placed["FlyIngress"]] == [HEAD]
    assert [p.node_type for p in placed["FlyTarget"]] == [TARGET]
    assert [p.node_type for p in placed["FlyDrafter"]] == [DRAFTER]
    # the TP ranks: this replica's (the pids it reports), both beside it (STRICT_PACK on its node)
    from ray import serve

    target = serve.get_deployment_handle("FlyTarget", "fly").report.remote().result(timeout_s=30)
    ranks = [p for p in placed["TPWorker"] if p.pid in target.rank_pids]
    assert len(ranks) == 2 and {p.node_id for p in ranks} == {placed["FlyTarget"][0].node_id}
    nodes = {placed[k][0].node_id for k in ("FlyIngress", "FlyTarget", "FlyDrafter")}
    assert len(nodes) == 3  # three parts, three nodes: every round's calls cross nodes
    assert stats(cluster.url)["drafter_cache"]["forwards"] > 0  # the drafter node's replica drafted those outputs


# ---- 3: a drafter node joins, the pool grows onto it under load, then back to its minimum
def test_a_drafter_node_that_joins_gets_a_replica_under_load_and_the_pool_shrinks_when_idle(cluster, reference):
    assert until(lambda: True if running("FlyDrafter") == 1 else None, SCALE_S), "not at its minimum before"
    first = cluster.where("FlyDrafter")[0].node_id
    t_join = time.monotonic()
    joined = cluster.add(DRAFTER)
    while running("FlyDrafter") < 2:
        assert time.monotonic() - t_join < SCALE_S, "no second drafter replica under load"
        for prompt, text in wave(cluster.url):
            assert text == reference[prompt]
    grown_s = time.monotonic() - t_join
    by_node = {p.pid: p.node_id for p in cluster.where("FlyDrafter")}
    assert set(by_node.values()) == {first, joined.node_id}  # the new replica is on the node that joined
    pids = per_replica("FlyDrafter", "pid", 2)
    before = [r["rows"] for r in per_replica("FlyDrafter", "cache_report", 2)]

    def both_drafted():  # waves until the ingress's count of live replicas (LiveReplicas' ttl) has both
        for prompt, text in wave(cluster.url):
            assert text == reference[prompt]
        after = [r["rows"] for r in per_replica("FlyDrafter", "cache_report", 2)]
        return after if all(a > b for a, b in zip(after, before)) else None

    after = until(both_drafted, SCALE_S)
    assert after is not None, "rows were not drafted on both drafter nodes"
    rows = {by_node[pid][:8]: a - b for pid, a, b in zip(pids, after, before)}
    t_idle = time.monotonic()
    shrunk = until(lambda: time.monotonic() if running("FlyDrafter") == 1 else None, SCALE_S)
    # the stopped replica's process ends once its calls are done (graceful shutdown)
    gone = until(lambda: time.monotonic() if len(cluster.where("FlyDrafter")) == 1 else None, SCALE_S)
    report(
        "drafter node joined",
        {
            "grown_s": round(grown_s, 1),
            "rows_per_node": rows,
            "idle_to_min_s": shrunk and round(shrunk - t_idle, 1),
            "replica_process_gone_s": gone and round(gone - t_idle, 1),
        },
    )
    assert shrunk is not None, "the pool did not scale back to its minimum when idle"
    assert gone is not None, "the stopped drafter replica's process is still alive"


# ---- 4a: the drafter node dies mid-generation
def test_a_drafter_node_killed_mid_generation_fails_no_request(cluster, reference):
    replicas = cluster.where("FlyDrafter")
    assert replicas and len(cluster.of_type(DRAFTER)) == 2, "the test before leaves a replica and 2 drafter nodes"
    victim = replicas[0].node_id  # a node with a replica (with 2 replicas, the other one survives)
    body = {"prompt": PROMPTS[0], "max_tokens": LONG_TOKENS, "fly": {"mode": "fly", "k": 2, "window": 1}}
    flight = InFlight(cluster.url, body, n_plain=2, n_stream=1)
    wait_generating(cluster.url, len(flight), timeout_s=60, rounds=2)
    t_kill = cluster.kill(cluster.node(victim))
    in_flight = flight.gather(RECOVERY_S)
    later = []  # requests while the pool recovers: each must succeed too

    def drafting_elsewhere():
        """A replica on a live node, and a request that its model drafted for."""
        if not any(p.node_id != victim for p in cluster.where("FlyDrafter")):
            return None
        before = forwards_by_replica()
        later.append(complete(cluster.url, {"prompt": PROMPTS[1], "max_tokens": 24, "fly": FLY}, timeout_s=120))
        after = forwards_by_replica()
        return time.monotonic() if any(n > before.get(pid, 0) for pid, n in after.items()) else None

    back = until(drafting_elsewhere, RECOVERY_S)
    report(
        "drafter node killed",
        {
            "in_flight": [o.kind for o in in_flight],
            "ended_s_after_kill": [round(o.ended - t_kill, 1) for o in in_flight],
            "drafting_again_s": back and round(back - t_kill, 1),
            "requests_meanwhile": [o.kind for o in later],
            "replicas_on": [p.node_type for p in cluster.where("FlyDrafter")],
        },
    )
    assert [o.kind for o in in_flight] == ["ok"] * 3, [o.detail for o in in_flight]
    assert all(o.finished_normally and o.ended > t_kill for o in in_flight)
    assert back is not None, "no drafter replica drafted on another node"
    assert [o.kind for o in later] == ["ok"] * len(later), [o.detail for o in later]
    # the GCS lists the dead node's replica until it has noticed the node's death
    assert until(lambda: all(p.node_id != victim for p in cluster.where("FlyDrafter")) or None, 60)
    for prompt in PROMPTS:
        assert generate(cluster.url, prompt) == reference[prompt]


# ---- 4b: the target node dies mid-generation; a new one joins
def test_a_target_node_killed_errors_cleanly_then_a_new_target_node_serves(cluster, reference):
    [old] = cluster.of_type(TARGET)
    ingress = [p.pid for p in cluster.where("FlyIngress")]
    body = {"prompt": PROMPTS[0], "max_tokens": LONG_TOKENS, "fly": {"mode": "ar"}}
    flight = InFlight(cluster.url, body, n_plain=2, n_stream=1)
    wait_generating(cluster.url, len(flight), timeout_s=60, rounds=2)
    health = HealthWatch(cluster.url)
    try:
        t_kill = cluster.kill(old)
        in_flight = flight.gather(RECOVERY_S)
        unhealthy = wait_status(cluster.url, 503, RECOVERY_S)
        refused = complete(cluster.url, {"prompt": PROMPTS[1], "max_tokens": 4}, timeout_s=RECOVERY_S)
        t_join = time.monotonic()
        joined = cluster.add(TARGET)
        probe = {"prompt": PROMPTS[1], "max_tokens": 4}
        probes = probe_until(cluster.url, probe, lambda ps: bool(ps) and ps[-1].kind == "ok", RECOVERY_S, 60)
        # the watch polls every 0.2 s: a probe may succeed before it has seen the 200
        back_200 = until(lambda: health.first(200, after_s=(unhealthy or t_kill) - health.t0), RECOVERY_S, 0.1)
    finally:
        health.close()
    ok = probes[-1].ended if probes and probes[-1].kind == "ok" else None
    report(
        "target node killed",
        {
            "in_flight": [o.failure if o.kind != "ok" else "ok" for o in in_flight],
            "ended_s_after_kill": [round(o.ended - t_kill, 1) for o in in_flight],
            "healthz_503_s": unhealthy and round(unhealthy - t_kill, 1),
            "refused_meanwhile": refused.failure,
            "target_node_joined_s": round(t_join - t_kill, 1),
            "healthz_200_again_s": back_200 and round(back_200 - (t_kill - health.t0), 1),
            "first_success_s": ok and round(ok - t_kill, 1),
            "first_success_after_join_s": ok and round(ok - t_join, 1),
            "probes": [p.status for p in probes],
        },
    )
    # the in-flight requests end with an error answer (a stream: its error event), none cut or hung
    assert [o.kind for o in in_flight] == ["error"] * 3, [o.detail for o in in_flight]
    assert all(o.ended > t_kill for o in in_flight)
    assert unhealthy is not None, "/healthz never said 503 with no target"
    assert refused.kind == "error" and refused.status == 503, refused.detail
    assert back_200 is not None and back_200 + health.t0 > t_join  # 503 until a target node was back
    assert ok is not None, f"no request succeeded after a target node joined: {[p.detail for p in probes[-3:]]}"
    assert all(p.kind == "error" and p.status == 503 for p in probes[:-1]), [p.failure for p in probes]
    # the new replica and both its ranks on the node that joined, the app itself never restarted
    assert [p.node_id for p in cluster.where("FlyTarget")] == [joined.node_id]
    assert {p.node_id for p in cluster.where("TPWorker")} == {joined.node_id}
    assert [p.pid for p in cluster.where("FlyIngress")] == ingress  # the same ingress process throughout
    for prompt in PROMPTS:
        assert generate(cluster.url, prompt) == reference[prompt]
