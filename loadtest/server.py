"""`fly-serve serve`, or the local multi-node cluster, as a child process of this one, in a session of
its own, its output collected; 127.0.0.1 only. A graceful stop (SIGTERM), and a kill of its whole
process group (the Ray it started lives there)."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from fly_serve.runtime.tp import free_port

from .waits import until

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "deployments" / "profiles"


class ChildProcess:
    """`python -m <module> <args>` of this repository in a session of its own, its output
    collected, serving on 127.0.0.1:port. FLY_API_KEY is left out of its environment: the run's
    clients send no key."""

    def __init__(self, module: str, args: list[str], port: int):
        self.lines: list[str] = []
        env = {k: v for k, v in os.environ.items() if k != "FLY_API_KEY"} | {"RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its Ray lives in this process group: kill_group reaches all of it
        )
        self.url = f"http://127.0.0.1:{port}"
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout_s: float) -> bool:
        """Whether a line of its output holds `text` within timeout_s (False once it has exited)."""

        def seen() -> bool | None:
            if self.proc.poll() is not None:
                self.reader.join(timeout=10)  # its last lines, up to the end of its output
                return any(text in line for line in self.lines)
            return True if any(text in line for line in self.lines) else None

        return bool(until(seen, timeout_s))

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (a graceful stop), then the whole group if it is not gone within timeout_s;
        returns the exit status of the graceful stop (None: it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        rc = self.proc.poll()
        self.kill_group()
        return rc

    def kill_group(self) -> None:
        """The process and the Ray it started (its process group), whatever state they are in."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.proc.wait(timeout=30)

    @property
    def pid(self) -> int:
        return self.proc.pid


class ServeProcess(ChildProcess):
    """`fly-serve serve` (python -m fly_cli.main serve ...) on 127.0.0.1."""

    def __init__(
        self,
        port: int = 0,
        *,
        tiny: bool = False,
        config: str | None = None,
        grace_s: float | None = None,
        num_cpus: int | None = None,
    ):
        port = port or free_port()
        args = ["serve", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--tiny"] if tiny else []
        args += ["--config", config] if config else []
        args += ["--grace-s", str(grace_s)] if grace_s is not None else []
        args += ["--num-cpus", str(num_cpus)] if num_cpus is not None else []
        super().__init__("fly_cli.main", args, port)


class ClusterProcess(ChildProcess):
    """`python -m deployments.local_cluster` (a head and worker raylets on 127.0.0.1, the app
    deployed on them); args: its own flags (--tiny, --one-node, --add, --deployments ...). Its
    SIGTERM stops every node it started."""

    def __init__(self, port: int = 0, args: list[str] = ()):
        port = port or free_port()
        super().__init__("deployments.local_cluster", ["--port", str(port), *args], port)

    def ready(self, timeout_s: float) -> bool:
        return self.wait_for("local-cluster: ready", timeout_s)


def profile_path(profile: str) -> Path:
    """A Serve config: a path to a YAML, or the name of one in deployments/profiles/ ("cpu-default")."""
    path = Path(profile)
    return path if path.suffix in (".yaml", ".yml") else PROFILES / f"{profile}.yaml"
