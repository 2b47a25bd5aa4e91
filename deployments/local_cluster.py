"""A Ray cluster of several nodes on this machine, for the multi-node app's tests and measurements.

A head and worker raylets on 127.0.0.1, started as ray.cluster_utils.Cluster starts them; each is
a real Ray node, with its own object store and its own workers, so what the app sends between its
parts crosses nodes as it would between machines (over loopback). The nodes carry the custom resources of the
node types in cluster-local.yaml (cluster.yaml's format and resource names), and a Serve profile
(deployments/profiles/cpu-multinode.yaml) is deployed on them as `serve deploy` would, so its placement is
the profile's own. Nodes join (`add`) and die (`kill`: the raylet SIGKILLed, its workers end
with it) while the app runs. Where each replica and TP rank runs comes from the GCS's actor table.

    python -m deployments.local_cluster [--tiny] [--one-node] [--port 8000] [--add drafter_1gpu=2]

starts the cluster (`--one-node`: one node holding every node type's resources, the same profile
unchanged), deploys the profile, prints "local-cluster: ready at URL" and blocks until SIGTERM or
Ctrl-C, then stops every process it started.
"""

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .launch import StopSignals, deploy_config, prepare_environment, wait_ready

ROOT = Path(__file__).resolve().parent.parent
NODE_TYPES = ROOT / "cluster-local.yaml"
PROFILE = ROOT / "deployments" / "profiles" / "cpu-multinode.yaml"
HOST = "127.0.0.1"
OBJECT_STORE_BYTES = 80 * 2**20  # per node: above Ray's floor (75 MiB); rows and drafts are small
# The GCS pings every raylet; with Ray's defaults (every 3 s, dead after 5 misses) a lost node is
# noticed after ~15 s, and calls to its replicas wait that long. Every second here; 3 s a ping and
# 5 misses in a row: a raylet on a busy 2-core box is slow, not dead.
NODE_HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 3000, "health_check_failure_threshold": 5}
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class NodeType:
    name: str
    cpus: int  # logical CPUs (`ray start --num-cpus`)
    resources: dict  # the custom ones (fly_target_gpu ...)
    min_workers: int


def node_types(path: Path = NODE_TYPES) -> tuple[str, dict[str, NodeType]]:
    """The head node type's name and every node type, from a cluster.yaml-format file."""
    raw = yaml.safe_load(Path(path).read_text())
    types = {}
    for name, t in raw["available_node_types"].items():
        resources = dict(t.get("resources", {}))
        cpus = resources.pop("CPU", 0)
        types[name] = NodeType(name, int(cpus), resources, int(t.get("min_workers", 0)))
    return raw["head_node_type"], types


def merged(types: list[NodeType], name: str) -> NodeType:
    """One node type holding all of `types`' resources (the one-node layout)."""
    resources: dict = {}
    for t in types:
        for k, v in t.resources.items():
            resources[k] = resources.get(k, 0) + v
    return NodeType(name, sum(t.cpus for t in types), resources, 0)


@dataclass
class LocalNode:
    type: str
    node: object  # ray._private.node.Node

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def raylet(self):
        """The raylet's process (a subprocess.Popen this process started)."""
        from ray._private import ray_constants

        return self.node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process


@dataclass(frozen=True)
class Placed:
    """A live actor and the node it runs on, as the GCS's actor table says."""

    actor: str  # a Serve replica's deployment ("FlyTarget"), else its class ("TPWorker")
    pid: int
    node_id: str
    node_type: str | None  # None: a node this cluster did not start


class LocalCluster:
    def __init__(self, path: Path = NODE_TYPES, one_node: bool = False):
        self.head_type, self.types = node_types(path)
        self.one_node = one_node
        self.nodes: list[LocalNode] = []  # alive, the head first
        self.url: str | None = None  # the app's, once deployed

    # ---- nodes
    def start(self) -> "LocalCluster":
        """The head (this process is its driver, as `ray.init` starts a local Ray), then
        min_workers nodes of each worker type (none with one_node: the head holds them all).
        Not ray.cluster_utils.Cluster's head: a driver connecting to it by address has 127.0.0.1
        replaced with the machine's address (services.resolve_ip_for_localhost), where nothing
        listens; its worker nodes are started here the way it starts them."""
        prepare_environment()  # before the first node: every raylet and its workers inherit it
        import ray

        workers = [t for name, t in self.types.items() if name != self.head_type for _ in range(t.min_workers)]
        head = self.types[self.head_type]
        if self.one_node:
            head, workers = merged([head, *workers], self.head_type), []
        ray.init(
            address="local",  # a Ray of its own, never one that another process on this machine started
            _node_ip_address=HOST,
            num_cpus=head.cpus,
            resources=dict(head.resources),
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            _system_config=NODE_HEALTH,
            log_to_driver=False,
            configure_logging=False,
        )
        self.nodes.append(LocalNode(head.name, ray._private.worker.global_worker.node))
        for t in workers:
            self.add(t.name)
        return self

    def add(self, type_name: str) -> LocalNode:
        """A node of the type joins: a raylet of its own on 127.0.0.1 (as Cluster.add_node starts
        one); returns once the GCS lists it."""
        from ray._private import services
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        t = self.types[type_name]
        params = RayParams(
            gcs_address=self.nodes[0].node.gcs_address,
            node_ip_address=HOST,
            num_cpus=t.cpus,
            num_gpus=0,
            resources=dict(t.resources),
            object_store_memory=OBJECT_STORE_BYTES,
            min_worker_port=0,
            max_worker_port=0,
            node_manager_port=0,
            include_log_monitor=False,  # one per machine: the head's
        )
        params.dashboard_agent_listen_port = None  # a free port, not the head agent's
        # shutdown_at_exit / spawn_reaper: the node's processes end with this one whatever happens
        node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
        services.wait_for_node(node.gcs_address, node.plasma_store_socket_name, 30)
        self.nodes.append(LocalNode(type_name, node))
        return self.nodes[-1]

    def kill(self, node: LocalNode) -> float:
        """SIGKILL the node's raylet, as when its machine dies: its workers, the replicas on it,
        end with it. Then what is left of the node's processes is reaped. Only a process this
        object started is signalled, by its pid. Returns when the raylet was killed (monotonic)."""
        if node not in self.nodes[1:]:
            raise ValueError("only a worker node this cluster started can be killed")
        t_kill = time.monotonic()
        os.kill(node.raylet.pid, signal.SIGKILL)
        self._stop_node(node, graceful=False)
        return t_kill

    def _stop_node(self, node: LocalNode, graceful: bool) -> None:
        node.node.kill_all_processes(check_alive=False, allow_graceful=graceful, wait=True)
        self.nodes.remove(node)

    def of_type(self, type_name: str) -> list[LocalNode]:
        return [n for n in self.nodes if n.type == type_name]

    def type_of(self, node_id: str) -> str | None:
        return next((n.type for n in self.nodes if n.node_id == node_id), None)

    def node(self, node_id: str) -> LocalNode | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    # ---- the app
    def deploy(
        self,
        profile: Path = PROFILE,
        port: int = 8000,
        tiny: bool = False,
        args: dict | None = None,
        deployments: dict[str, dict] | None = None,
    ) -> str:
        """Deploys a Serve profile as `serve deploy` does, HTTP on 127.0.0.1:port; `args` and
        `deployments` (by name) override the profile's. Returns the app's URL (not yet ready)."""
        from ray.serve.schema import ServeDeploySchema

        raw = yaml.safe_load(Path(profile).read_text())
        raw["http_options"] = {**raw.get("http_options", {}), "host": HOST, "port": port}
        for app in raw["applications"]:
            app["args"] = {**app.get("args", {}), **({"tiny": True} if tiny else {}), **(args or {})}
            for d in app.get("deployments", []):
                d.update((deployments or {}).get(d["name"], {}))
        deploy_config(ServeDeploySchema.model_validate(raw))
        self.url = f"http://{HOST}:{port}"
        return self.url

    def placed(self) -> list[Placed]:
        """Every live actor and its node. The GCS's actor table is read directly (the state API
        needs the dashboard, which this cluster leaves off); pyproject bounds ray[serve]."""
        from ray._private import state

        out = []
        for info in state.actors(actor_state_name="ALIVE").values():
            name = info["ActorClassName"]
            node_id = info["Address"]["NodeID"]
            # a Serve replica's class is "ServeReplica:<app>:<deployment>"
            out.append(Placed(name.rsplit(":", 1)[-1], info["Pid"], node_id, self.type_of(node_id)))
        return out

    def where(self, actor: str) -> list[Placed]:
        return [p for p in self.placed() if p.actor == actor]

    def shutdown(self) -> None:
        """Every node's processes stopped (workers, raylets, the GCS). Serve first, while the
        nodes are up: it also ends this process's Serve client and its handles' routers, whose
        metrics tasks would otherwise outlive the session and fail in the next one."""
        import ray
        from ray import serve

        try:
            serve.shutdown()
        except Exception as e:  # a cluster already half gone still has its nodes stopped below
            print(f"local-cluster: serve.shutdown failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        for node in self.nodes[1:]:
            self._stop_node(node, graceful=True)
        ray.shutdown()  # the head: this process started it
        self.nodes.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.local_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=str(PROFILE))
    p.add_argument("--nodes", default=str(NODE_TYPES), help="node types, cluster.yaml format (%(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tiny", action="store_true", help="tiny random models (for mechanics)")
    p.add_argument("--one-node", action="store_true", help="one node holding every node type's resources")
    p.add_argument("--add", nargs="*", default=[], metavar="TYPE=N", help="N more nodes of TYPE at start")
    p.add_argument("--args", default="{}", help="JSON: the profile's args overridden")
    p.add_argument("--deployments", default="{}", help='JSON: {"FlyDrafter": {...}} overrides by deployment')
    a = p.parse_args(argv)
    stop = StopSignals()
    cluster = LocalCluster(Path(a.nodes), one_node=a.one_node)
    try:
        cluster.start()
        for spec in a.add:
            name, n = spec.split("=")
            for _ in range(int(n)):
                cluster.add(name)
        stop.install()  # ray.init replaces the SIGTERM handler
        url = cluster.deploy(a.profile, a.port, a.tiny, yaml.safe_load(a.args), yaml.safe_load(a.deployments))
        nodes = ", ".join(f"{n.type} {n.node_id[:8]} (raylet {n.raylet.pid})" for n in cluster.nodes)
        print(f"local-cluster: nodes {nodes}", flush=True)
        if not wait_ready(url, stop.requested, READY_TIMEOUT_S):
            print("local-cluster: the application did not become ready", file=sys.stderr, flush=True)
            return 1
        print(f"local-cluster: ready at {url}", flush=True)
        stop.requested.wait()
        return 0
    finally:
        cluster.shutdown()
        print("local-cluster: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
