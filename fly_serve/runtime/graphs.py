"""One-token forwards (decode steps) replayed from CUDA graphs.

A 0.5B / 1.5B model's one-token forward on a GPU is launch-bound: hundreds of small kernels, each
launched from Python, cost more than the math, so the drafter costs about what the target does
and speculation cannot pay. A CUDA graph replays the whole step with one launch.

A graph has fixed shapes and fixed addresses, so each step runs on static buffers: the batch is
padded to a bucket (BATCH_BUCKETS), the keys to a power of two (key_bucket), and the step reads
the paged cache through a block table held in a static buffer. Padding rows point at the scratch
block (kv_cache.SCRATCH) at position 0, so they write only there; keys past a row's end are
masked. The pool itself must never move after a capture: on a GPU it is allocated whole at start
(runner.grown_from).

The same static step runs eagerly when `replay` is False: that is how the CPU tests it.
"""

import logging

import torch

from .kv_cache import SCRATCH
from .kv_io import GatherIO

log = logging.getLogger(__name__)

CAPTURE = ("auto", "on", "off")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEYS = 256  # the smallest key bucket: short contexts share one graph


def capture_mode(device: torch.device | str, requested: str = "auto", tp: int = 1) -> str:
    """ "graphs" or "off" for a runner on `device` with `tp` ranks.

    auto: graphs on a CUDA device without tensor parallelism (a captured all-reduce needs NCCL
    graph support checked on the real cluster first), off elsewhere. on: graphs, refused where they
    cannot run. off: never."""
    if requested not in CAPTURE:
        raise ValueError(f"capture: must be one of {', '.join(CAPTURE)} (got {requested!r})")
    why_not = None
    if torch.device(device).type != "cuda":
        why_not = f"CUDA graphs need a CUDA device (this runner is on {torch.device(device).type})"
    elif tp > 1:
        why_not = "not under tensor parallelism yet"
    if requested == "off" or (why_not and requested == "auto"):
        return "off"
    if why_not:
        raise ValueError(f"capture: {why_not}")
    return "graphs"


def batch_bucket(b: int) -> int | None:
    return next((n for n in BATCH_BUCKETS if n >= b), None)


def key_bucket(n_keys: int) -> int:
    """Keys padded to a power of two (at least MIN_KEYS): a few graphs cover every length."""
    return max(MIN_KEYS, 1 << (n_keys - 1).bit_length())


class _Static:
    """The buffers one graph reads and writes: ids [B, 1], pos [B, 1], table [B, n_blocks], out."""

    def __init__(self, batch: int, n_blocks: int, device):
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.table = torch.full((batch, n_blocks), SCRATCH, dtype=torch.long, device=device)
        self.out = None
        self.graph = None


class DecodeGraphs:
    """Captured one-token forwards of a Runner, one graph per (batch bucket, key bucket), captured
    at first use. A capture that fails is logged and turns capture off for this runner: the
    eager forward is always there."""

    def __init__(self, runner, replay: bool = True):
        self.runner, self.replay = runner, replay
        self.static: dict[tuple[int, int], _Static] = {}
        self.pool = None  # one memory pool shared by every graph (they never run at once)
        self.failed: str | None = None
        self.replays = 0

    def takes(self, B: int, T: int, starts: torch.Tensor, logits_at) -> bool:
        """Whether this forward is a decode step a graph can run: one token per row, logits wanted
        at it, a batch within the largest bucket."""
        if self.failed or T != 1 or batch_bucket(B) is None:
            return False
        if logits_at is None:
            return False
        return isinstance(logits_at, str) or not bool(logits_at.any())

    @torch.inference_mode()
    def run(self, seqs: list[int], starts: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Logits [B, 1, V] of one token per row, as Runner.forward gives them; None when the
        capture failed (the caller then runs the eager forward)."""
        B = len(seqs)
        Bb, Kb = batch_bucket(B), key_bucket(int(starts.max()) + 1)
        s = self.static.get((Bb, Kb))
        if s is None:
            s = self._capture(Bb, Kb)
            if s is None:
                return None
        table = self.runner.cache.block_table(seqs, s.table.shape[1])  # [B, n_blocks] on the CPU
        s.table.fill_(SCRATCH)
        s.table[:B].copy_(table, non_blocking=True)
        s.ids.zero_()
        s.ids[:B].copy_(input_ids)
        s.pos.zero_()
        s.pos[:B, 0].copy_(starts, non_blocking=True)
        if s.graph is not None:
            s.graph.replay()
        else:
            s.out = self._step(s, Kb)
        self.replays += 1
        return s.out[:B].clone()  # the graph's output buffer is overwritten by the next replay

    def _step(self, s: _Static, n_keys: int) -> torch.Tensor:
        """The captured function: the runner's own layers on the static buffers."""

        r = self.runner
        io = GatherIO(s.table, s.pos, r.cache.block_size, n_keys)
        keys = torch.arange(n_keys, device=s.pos.device)
        mask = (keys[None, None, :] <= s.pos[:, :, None])[:, None]  # [B, 1, 1, n_keys]
        return r.logits(r.layers_forward(s.ids, s.pos, io, mask, False))

    def _capture(self, Bb: int, Kb: int) -> _Static | None:
        r = self.runner
        s = _Static(Bb, Kb // r.cache.block_size, r.device)
        if self.replay:
            try:
                self._record(s, Kb)
            except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager path
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed (batch %d, keys %d); eager forwards: %s", Bb, Kb, self.failed)
                return None
        self.static[(Bb, Kb)] = s
        return s

    def _record(self, s: _Static, n_keys: int) -> None:
        # Warm up on a side stream first (kernel choice, workspaces outside the graph); the static
        # buffers point every row at the scratch block, so these runs touch no sequence's cache.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(s, n_keys)
        torch.cuda.current_stream().wait_stream(side)
        s.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(s.graph, pool=self.pool):
            s.out = self._step(s, n_keys)
        self.pool = s.graph.pool()
