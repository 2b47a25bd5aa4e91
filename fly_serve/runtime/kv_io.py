"""How a forward reads and writes a layer's keys and values in the paged pool (kv_cache.py): a
row whose blocks are consecutive as a slice (no copy), other rows by gathering whole blocks.
The runner picks one per forward; the CUDA graphs (graphs.py) replay the gather."""

import torch


class SliceIO:
    """One row whose blocks are consecutive in the pool: its keys are a slice of the pool (a view,
    no copy), as in a cache of fixed slots."""

    def __init__(self, base: int, start: int, n_new: int, n_keys: int):
        self.lo, self.hi, self.base, self.n_keys = base + start, base + start + n_new, base, n_keys

    def write(self, pool: torch.Tensor, new: torch.Tensor):
        pool[self.lo : self.hi] = new

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        return pool[self.base : self.base + self.n_keys][None]


class GatherIO:
    """Rows anywhere in the pool: writes scatter token rows, reads gather whole blocks."""

    def __init__(self, table: torch.Tensor, pos: torch.Tensor, block_size: int, n_keys: int):
        # table [B, n_blocks] -> pool rows of the new tokens [B*T] ...
        self.rows = (table.gather(1, pos // block_size) * block_size + pos % block_size).flatten()
        # ... and the blocks to read, whole blocks being cheaper to copy than token rows.
        self.blocks, self.shape, self.n_keys, self.block_size = table.flatten(), table.shape, n_keys, block_size

    def write(self, pool: torch.Tensor, new: torch.Tensor):
        pool.index_copy_(0, self.rows, new)

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        B, n_blocks = self.shape
        # Blocks as flat rows: index_select then copies each with one memcpy.
        blocks = pool.view(-1, self.block_size * pool[0].numel()).index_select(0, self.blocks)
        return blocks.view(B, n_blocks * self.block_size, *pool.shape[1:])[:, : self.n_keys]
