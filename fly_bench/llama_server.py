"""llama.cpp's own `llama-server` as a peer on the same GGUF files: found, started as a child
process on 127.0.0.1, asked for completions, stopped.

The binary: $FLY_LLAMA_SERVER, else the one scripts/build_llama_server.sh builds from the very
llama.cpp source the installed llama-cpp-python was built from (~/.cache/fly-serve/llama.cpp-<its
version>/src/build/bin/llama-server), else one on PATH. Requests go to its /completion endpoint
with the prompt as token ids, so the peer reads exactly the tokens fly-serve's engine reads; each
answer keeps its tokens, its text, its wall time, its time to first token (streamed) and the
server's own `timings` (tokens per second, drafts made and accepted).

The server runs with the kernels fly-serve's llama.cpp runtime uses: weights repacked for llama.cpp's
faster CPU kernels unless its AMX kernels would take them (llama_runner.amx_kernels_unsafe: then
neither repacks) and flash attention on, as LlamaRunner. Its KV cache is left as a user who
starts `llama-server --parallel N` gets it: one stream of ctx-size / N cells per slot, each query
attending to its own slot's cells (fly-serve's runtime keeps one pool for all rows, kv_unified;
`flags={"kv-unified": True}` starts the peer that way). With 8 slots of 8 chats at once the
per-slot cache ran 1.05-1.24x the unified one here (docs/journal.md, "The peer's KV cache as a user
starts it").
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

from fly_serve.loading.weights import cache_dir
from fly_serve.runtime.llama_runner import LlamaCppMissing, amx_kernels_unsafe, default_threads
from fly_serve.runtime.tp import free_port

BUILD = "scripts/build_llama_server.sh"
START_TIMEOUT_S = 300.0  # loading a GGUF and the server's warm-up run
REQUEST_TIMEOUT_S = 900.0  # a client waits this long for the next bytes of an answer
FINISH = {"limit": "length", "eos": "stop", "word": "stop"}  # the server's stop_type -> finish_reason


class LlamaServerMissing(RuntimeError):
    """No llama-server binary was found: named, with how to build one."""


def llama_cpp_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def find_binary() -> Path:
    """The llama-server to run ($FLY_LLAMA_SERVER, the build of this llama-cpp-python's source, PATH)."""
    env = os.environ.get("FLY_LLAMA_SERVER")
    if env:
        path = Path(env).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LlamaServerMissing(f"FLY_LLAMA_SERVER={env}: not an executable file")
        return path
    version = llama_cpp_version()
    if version:
        built = cache_dir() / f"llama.cpp-{version}" / "src" / "build" / "bin" / "llama-server"
        if built.is_file():
            return built
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    where = f"{cache_dir()}/llama.cpp-{version}/src/build/bin/" if version else "the llama-cpp-python build folder"
    raise LlamaServerMissing(
        f"llama-server: not found ($FLY_LLAMA_SERVER unset, none in {where}, none on PATH). Build it from the "
        f"llama.cpp source of the installed llama-cpp-python with `{BUILD}` (about 10 minutes on 2 cores), "
        "or point FLY_LLAMA_SERVER at one"
    )


def repack_allowed() -> bool:
    """Whether the server may repack weights: as fly-serve's runtime does (GGUFModel)."""
    try:
        return not amx_kernels_unsafe()
    except LlamaCppMissing:  # nothing to ask which kernels a build has: llama.cpp's default
        return True


@dataclass
class Completion:
    """One answer of the server."""

    token_ids: list[int]
    text: str
    finish_reason: str
    wall_s: float  # the request's own wall time (sent to last byte)
    ttft_s: float | None  # sent to the first generated token's chunk
    timings: dict = field(default_factory=dict)  # the server's: predicted_per_second, draft_n, ...


def flag_args(flags: dict) -> list[str]:
    """{"spec-draft-n-max": 16, "no-repack": True} -> ["--spec-draft-n-max", "16", "--no-repack"]."""
    out = []
    for key, value in flags.items():
        if value is False or value is None:
            continue
        out.append(f"--{key}")
        if value is not True:
            out.append(str(value))
    return out


class LlamaServer:
    """`llama-server` on model (and draft, a draft model) as a child process on 127.0.0.1 and a
    free port, with `slots` parallel sequences (continuous batching) of `context` tokens each and
    `threads` threads (default: the cores this process may use). spec_type: llama.cpp's
    speculative decoding (--spec-type: "draft-simple" with a draft model, "ngram-simple", ...);
    flags: more of its flags, without their dashes ({"spec-draft-n-max": 16}). A context manager:
    ready (its /health answers ok) on entry, killed on exit."""

    def __init__(
        self,
        model: str | Path,
        *,
        draft: str | Path | None = None,
        threads: int | None = None,
        slots: int = 1,
        context: int = 4096,
        spec_type: str | None = None,
        flags: dict | None = None,
        binary: Path | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.binary = binary or find_binary()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.slots, self.start_timeout_s = slots, start_timeout_s
        self.threads = threads or default_threads()
        self.args = [
            str(self.binary),
            *("--model", str(model), "--host", "127.0.0.1", "--port", str(self.port)),
            *("--threads", str(self.threads), "--parallel", str(slots), "--ctx-size", str(slots * context)),
            *("--flash-attn", "on", "--no-webui"),
            *([] if repack_allowed() else ["--no-repack"]),
            *(["--spec-draft-model", str(draft)] if draft else []),
            *(["--spec-type", spec_type] if spec_type else []),
            *flag_args(flags or {}),
        ]
        self.proc: subprocess.Popen | None = None
        self.log = None

    @property
    def command(self) -> str:
        """Its command line, for a report (the port left out: it differs per run)."""
        args = self.args[1:]
        i = args.index("--port")
        return " ".join(["llama-server", *args[:i], *args[i + 2 :]])

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        """Until /health answers 200 (503 while the model loads); an exit or the deadline raises,
        with the end of its output."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) while starting:\n{self.output()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server: not ready within {self.start_timeout_s:g} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self, chars: int = 4000) -> str:
        """The end of what the server has written."""
        if self.log is None:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not gone within timeout_s; only this child."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        if self.log is not None:
            self.log.close()
            self.log = None

    def version(self) -> str:
        """`llama-server --version`'s line naming the build."""
        run = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=60)
        lines = [line for line in (run.stdout + run.stderr).splitlines() if "version" in line]
        return lines[0].strip() if lines else "unknown"

    # ---- requests
    def complete(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop: list[str] | None = None,
        cache_prompt: bool = False,
    ) -> Completion:
        """One completion of token ids, streamed. Greedy at temperature 0 (top_k 1: the most likely
        token, whatever the other samplers would keep); above 0, plain sampling at that temperature
        (no top-k / top-p / min-p cut), seeded. cache_prompt False: the whole prompt is computed,
        as an engine without a prefix cache does."""
        greedy = temperature <= 0
        body = {
            "prompt": list(prompt),
            "n_predict": max_tokens,
            "temperature": 0.0 if greedy else temperature,
            "top_k": 1 if greedy else 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": seed,
            "stop": list(stop or []),
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        ttft, ids, text, last = None, [], [], {}
        with requests.post(f"{self.url}/completion", json=body, stream=True, timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                raise RuntimeError(f"llama-server /completion: HTTP {r.status_code}: {r.text[:300]}")
            for chunk in _events(r):
                if "error" in chunk:
                    raise RuntimeError(f"llama-server /completion: {chunk['error']}")
                if chunk.get("tokens") and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += chunk.get("tokens") or []
                text.append(chunk.get("content") or "")
                last = chunk
        wall = time.perf_counter() - t0
        if last.get("stop_type") == "eos" and ids:  # its tokens end with the EOS; the engine's do not
            ids = ids[:-1]
        finish = FINISH.get(last.get("stop_type"), last.get("stop_type") or "length")
        return Completion(ids, "".join(text), finish, wall, ttft, last.get("timings") or {})

    def complete_many(self, prompts: list[list[int]], settings: list[dict]) -> tuple[list[Completion], float]:
        """All prompts at once, one connection each (the server batches them over its slots);
        settings: complete()'s keywords per prompt. Returns the answers and the makespan."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, len(prompts))) as pool:
            futures = [pool.submit(self.complete, p, **s) for p, s in zip(prompts, settings)]
            outs = [f.result() for f in futures]
        return outs, time.perf_counter() - t0


def _events(response: requests.Response):
    """A server-sent event stream's JSON payloads."""
    for line in response.iter_lines(decode_unicode=True):
        if line and line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])
