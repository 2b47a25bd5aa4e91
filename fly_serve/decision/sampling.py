"""Sampling at T > 0: the processed distribution (temperature, then top-p), one random generator
per sequence, and standard speculative sampling of one row (lossless: tokens are distributed as
the target's processed distribution whatever the drafts were).

A row whose drafts are deterministic proposals (prompt lookup, the suffix index, Token Recycling:
a one-hot q) and that decides strictly draws each position's token from a generator keyed by the
row's seed and the position (`keyed_row`): what a seeded request emits then depends on neither the
drafts nor where rounds begin, so it repeats in `suffix` and `recycle` modes too, whose drafts
come from what the engine learned from earlier requests (a sequential stream would be consumed
differently with every different draft).

Everything runs where the logits are: on a GPU the full-vocabulary softmax, sort and draws stay on
the device (each row's generator lives there too) and only [K]-sized results reach the host. A
seeded request is reproducible on the same kind of device (CPU and CUDA generators differ)."""

import random

import torch

from fly_serve.contracts import Row

MASK64 = 2**64 - 1


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution: temperature, then nucleus (top-p) filtering."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = p.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


class Generators:
    """One torch.Generator per sequence, so a seeded request draws the same numbers whatever
    else shares its batch, and one generator per position of a sequence (`at`) for the draws that
    must not depend on how many came before. `salt` keeps the drafter's stream apart from the
    target's."""

    def __init__(self, salt: int, device: torch.device | str = "cpu"):
        self.salt, self.by_key, self.device = salt, {}, torch.device(device)
        self.bases: dict[str, int] = {}  # key -> the seed its positions' generators derive from
        self._at: torch.Generator | None = None  # reseeded for each position (`at`)

    def base(self, row: Row) -> int:
        """The row's seed as a generator takes it: any int64 maps into the range; none: random."""
        if row.key not in self.bases:
            seeded = row.seed is not None
            self.bases[row.key] = (row.seed * 1000003 + self.salt) % 2**63 if seeded else random.getrandbits(63)
        return self.bases[row.key]

    def get(self, row: Row) -> torch.Generator:
        if row.key not in self.by_key:
            g = torch.Generator(device=self.device)
            if row.seed is None:
                g.seed()
            else:
                g.manual_seed(self.base(row))
            self.by_key[row.key] = g
        return self.by_key[row.key]

    def at(self, row: Row, position: int) -> torch.Generator:
        """The generator of one position of the row's sequence: its numbers depend on the row's
        seed and the position alone (valid until the next call)."""
        if self._at is None:
            self._at = torch.Generator(device=self.device)
        return self._at.manual_seed(mix(self.base(row), position))

    def release(self, keys):
        for key in keys:
            self.by_key.pop(key, None)
            self.bases.pop(key, None)


def mix(base: int, position: int) -> int:
    """A seed of 63 bits for (base, position), splitmix64's finalizer: nearby positions get
    unrelated streams."""
    x = (base + (position + 1) * 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) >> 1


SPARSE_BELOW = 0.1  # q's nonzero fraction under which its sparse form is smaller (20 vs 4 bytes an entry)


def wire_q(q: torch.Tensor) -> torch.Tensor:
    """q [n, V] as it travels to the verifier (through Ray when the drafter is remote): its sparse
    COO form when top-p left few nonzeros (a nucleus of hundreds of ids out of 152k: kilobytes
    instead of n x 600 KB), else dense. Exact either way: the same numbers, densified on arrival."""
    nonzero = int((q != 0).sum())
    return q.to_sparse() if nonzero < SPARSE_BELOW * q.numel() else q


def _sample(p: torch.Tensor, generator) -> torch.Tensor:
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def speculative_row(p: torch.Tensor, drafts: torch.Tensor, n: int, q: torch.Tensor | None, generator):
    """Speculative sampling of one row, on p's device (the generator's). p [n+1, V] the target's
    processed distribution at the row's positions, drafts [K], q [n, V] or None (a one-hot
    proposal, as from prompt lookup). Returns, on the CPU, ok [K] (accepted: passed the p/q test)
    and y [K+1] (the recovered token, a residual sample, at each position; the bonus token, a sample
    of p, at position n)."""
    K, dev = drafts.shape[0], p.device
    d = drafts[:n].to(dev)
    at = torch.arange(n, device=dev)
    p_d = p[at, d]
    if q is None:
        q = torch.nn.functional.one_hot(d, p.shape[-1]).to(p.dtype)
    else:  # [n, V]; sparse when it came over the wire that way (wire_q)
        q = (q.to_dense() if q.is_sparse else q).to(dev)
    q_d = q[at, d]
    u = torch.rand(n, generator=generator, device=dev)
    ok = torch.zeros(K, dtype=torch.bool)
    ok[:n] = (u * q_d < p_d).cpu()  # u < p/q without dividing by zero
    residual = (p[:n] - q).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q: any sample of p is exact
    residual = torch.where(empty, p[:n], residual)
    y = torch.zeros(K + 1, dtype=torch.long)
    if n:
        y[:n] = _sample(residual / residual.sum(-1, keepdim=True), generator).cpu()
    y[n] = _sample(p[n], generator).cpu()
    return ok, y


def keyed_row(p: torch.Tensor, drafts: torch.Tensor, n: int, generator_at):
    """Speculative sampling of a row with deterministic drafts (a one-hot q) that decides
    strictly: the target's token at each position i of p [n+1, V] is drawn from p[i] with that
    position's own generator (generator_at(i)), and a draft is accepted when it is that token.
    Exact: a draft d is accepted with probability p(d), as by the p/q test, and a rejected
    position's token is p given it is not d, the residual (p - one_hot(d))+ normalized. Returns
    ok [K] and y [K+1] on the CPU, as speculative_row."""
    K = drafts.shape[0]
    drawn = torch.stack([_sample(p[i], generator_at(i)) for i in range(n + 1)]).cpu()
    y = torch.zeros(K + 1, dtype=torch.long)
    y[: n + 1] = drawn
    ok = torch.zeros(K, dtype=torch.bool)
    ok[:n] = drawn[:n] == drafts[:n].cpu()
    return ok, y
