"""Sampling at T > 0: the processed distribution (temperature, then top-p), keyed draws, and
standard speculative sampling of one row.

Keyed draws (the default for every sampled row). The token a sampled row emits at sequence
position i is argmax_v p_i(v) / E(v), E(v) an exponential(1) number that is a hash of (the row's
seed, i, v): the Gumbel-max trick (an exponential race), which draws exactly from p_i. The
drafter draws its draft at position i the same way from its own q_i, with the same numbers, and
the target accepts a draft iff it equals the target's own draw there. So:

- the committed text is exactly the target's own sample whatever the drafts, the round shapes,
  the mode, the batch or k "auto"'s choices were: a seeded request gives one text in ar, pld,
  spd, strict fly and k auto (lossless by construction: every committed token is the target's
  draw from p given the tokens before it);
- drafts agree with the target wherever p and q are close: the coupling accepts a draft with a
  probability between (1 - TV) / (1 + TV) and 1 - TV (TV: p and q's total variation distance),
  where speculative sampling's p/q test reaches 1 - TV (docs/journal.md: measured on the tiny pair);
- q never travels: the verifier compares tokens. A deterministic proposal (prompt lookup, the
  suffix index, Token Recycling) is verified the same way (accepted with probability p(d));
- the numbers are tensor ops on the logits' device (a counter-based hash, no generator objects,
  the same numbers on every device and batch), batched over rows and positions: nothing to
  capture but kernels.

FLy's loose decision at T > 0 reads the same draws: a mismatch is a draft that differs from the
target's keyed draw. A row without a seed gets a random one (the engine draws it once per
request, so drafter and target share it).

A drafter that ships its own q (Drafts.q, e.g. one whose draws are not keyed) is verified by
standard speculative sampling against it, from the row's own generator (`speculative_row`):
lossless, but its text then depends on the drafts.

Everything runs where the logits are: on a GPU the full-vocabulary softmax and draws stay on
the device and only [K]-sized results reach the host."""

import random

import torch

from fly_serve.contracts import Row

from .vocab_reads import argmax

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
    """One torch.Generator per sequence, for rows verified by speculative sampling against a q
    their drafter shipped (speculative_row): a seeded request draws the same numbers whatever
    else shares its batch."""

    def __init__(self, salt: int, device: torch.device | str = "cpu"):
        self.salt, self.by_key, self.device = salt, {}, torch.device(device)
        self.bases: dict[str, int] = {}  # key -> the seed its generator starts from

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


# ---- keyed draws (module docstring)
M32 = 0xFFFFFFFF
_VKEYS: dict[tuple[int, str], torch.Tensor] = {}  # per (vocabulary, device): each token id's own key
# Elements (positions x vocabulary) hashed at once: bounds the int32 / float32 temporaries
# (4M elements: 16 MB each on a CPU; a GPU takes 64M).
CHUNK = {"cpu": 1 << 22}
DEFAULT_CHUNK = 1 << 26


def seed_key(seed: int) -> int:
    """The 64-bit key of a row's seed (any int64), as drafter and target both derive it."""
    return mix(seed % 2**64, -1) << 1 | 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of x, int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """_mix32 in place on int32 (two's complement, products wrap): logical shifts as masked ones."""
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    x.mul_(0x7FEB352D)
    x.bitwise_xor_((x >> 15) & 0x1FFFF)
    x.mul_(0x846CA68B - 2**32)
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    return x


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 of the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def token_keys(ids: torch.Tensor) -> torch.Tensor:
    """int32 [V]: the key of each token id (int64 ids >= 0) in exponentials. A distribution laid
    out over another vocabulary draws with the numbers of the ids its columns stand for (a drafter
    of another tokenizer drafting by TLI: cross_vocab.py), so its draws and the target's agree."""
    return _int32(_mix32((ids * 0x9E3779B9) & M32))


def _token_keys(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _VKEYS:
        _VKEYS[key] = token_keys(torch.arange(vocab, dtype=torch.long, device=device))  # [V]
    return _VKEYS[key]


def position_keys(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int32 [N]: one key per (row key [N] int64, sequence position [N] int64)."""
    lo, hi = keys & M32, (keys >> 32) & M32
    return _int32(_mix32(_mix32(lo ^ _mix32(positions & M32)) ^ hi))


def exponentials(pos_keys: torch.Tensor, vocab: int, tkeys: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, vocab]: the exponential(1) number of every (position key, token id), from 24
    hashed bits, never 0 or inf. tkeys [vocab]: the columns' token keys (token_keys; None: the
    columns are the ids 0..vocab-1)."""
    tkeys = _token_keys(vocab, pos_keys.device) if tkeys is None else tkeys
    x = pos_keys[:, None] ^ tkeys[None, :]  # [N, V]
    _mix32_(x)
    u = ((x >> 8) & 0xFFFFFF).float().add_(0.5).mul_(2.0**-24)  # (0, 1)
    return u.log_().neg_()


def keyed_draw(
    p: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, tkeys: torch.Tensor | None = None
) -> torch.Tensor:
    """The token drawn from each distribution p [N, V] (probabilities, or any non-negative weights
    proportional to them) by the numbers of its (row key, position): argmax p / E. keys, positions
    [N] int64 on p's device; tkeys: p's columns' token keys (exponentials). Returns [N] int64 on
    p's device (column indices): no host read."""
    N, V = p.shape
    if N == 0:
        return torch.zeros(0, dtype=torch.long, device=p.device)
    pk = position_keys(keys, positions)
    step = max(1, CHUNK.get(p.device.type, DEFAULT_CHUNK) // V)
    out = [argmax(p[i : i + step].float() / exponentials(pk[i : i + step], V, tkeys)) for i in range(0, N, step)]
    return out[0] if len(out) == 1 else torch.cat(out)


class RowKeys:
    """Each row's key (seed_key of its seed); a row without a seed gets a random one, kept until
    it is released (the engine gives every sampled row a seed, so drafter and target agree)."""

    def __init__(self):
        self.random: dict[str, int] = {}

    def of(self, row: Row) -> int:
        if row.seed is not None:
            return seed_key(row.seed)
        if row.key not in self.random:
            self.random[row.key] = random.getrandbits(64) | 1
        return self.random[row.key]

    def tensor(self, rows: list[Row], repeat: int, device) -> torch.Tensor:
        """int64 [len(rows) * repeat]: each row's key, repeated for its positions."""
        signed = [k - 2**64 if k >= 2**63 else k for k in (self.of(r) for r in rows)]
        return torch.tensor(signed, dtype=torch.long).repeat_interleave(repeat).to(device)

    def release(self, keys) -> None:
        for key in keys:
            self.random.pop(key, None)


def probs_rows(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """probs of every row at once: logits [R, T, V], each row's temperature and top_p."""
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=logits.device)
    p = torch.softmax(logits.float() / temps[:, None, None], dim=-1)
    top_p = [r.top_p for r in rows]
    if min(top_p) < 1.0:
        cut = torch.tensor(top_p, dtype=torch.float32, device=logits.device)[:, None, None]
        sorted_p, idx = p.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p > cut) & (cut < 1.0)  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p
