"""The fixed-shape draft loop: k one-token drafter steps on static shapes, with no host read
inside, for a device where a forward replayed from a CUDA graph costs less than the host's work
around it (docs/GPU.md: on one H200 a 0.5B drafter's graph forward took 3.3 ms, a draft step of
the MLA loop 9.6 ms).

The MLA loop (drafters.ModelDrafter) is built for a CPU: there a drafter forward costs far more
than the host's work, so every forward is worth a prompt-lookup proposal, a check of it, a stop
as soon as a row is unsure, and per-row bookkeeping. Each of those reads the device, and the
shapes change from forward to forward, so nothing can be captured. This loop does the
opposite:

- the rows' caches are brought up to all but their last `width` tokens first (a row that drafted
  nothing for a while, k 0 under k "auto", catches up here, in one batched forward), and every
  row's KV blocks for its k drafts are reserved before the first step (kv_cache.KVCache.plan);
- step 0 feeds each row's last `width` tokens, every later step one token a row: shapes [B, 1]
  whatever the rows' lengths, which runner.Runner replays from its CUDA graphs (graphs.py);
- the next token is chosen on the device: argmax for greedy rows, the keyed draw for sampled
  rows (sampling.keyed_draw, batched: the draws the target will compare with), and the
  confidence stop (drafters.stopping: rows with a floor stop together) is a device mask: a
  stopped row keeps stepping (its shape is fixed) but drafts nothing more;
- every row steps max(k) times; a row whose k is smaller writes past its drafts into its own
  last block or the scratch block (kv_cache.SCRATCH), which no read sees;
- one read at the end: the drafts [B, K] and each row's count, in one copy (host.to_host); the
  cache records the tokens fed (KVCache.wrote).

Greedy drafts equal the MLA loop's without proposals (the same steps, forward for forward), and
sampled drafts are the same keyed draws. Rows the loop does not take (a grammar's masks need the
host at every step; a draft-ahead row's peek) go through the MLA loop.
"""

import torch

from fly_serve.contracts import ModelRunner, Row, RowTokens
from fly_serve.decision.host import to_host
from fly_serve.decision.sampling import RowKeys, keyed_draw, probs_rows
from fly_serve.decision.vocab_reads import argmax, top_prob

# The first step feeds at most this many tokens a row (a round whose drafts all passed leaves a
# lag of 2: the last draft and the bonus); a row lagging more catches up before the loop.
MAX_WIDTH = 4


class FixedLoop:
    def __init__(self, runner: ModelRunner, vocab_size: int, keys: RowKeys):
        self.runner, self.vocab_size, self.keys = runner, vocab_size, keys

    @staticmethod
    def runs_on(runner) -> bool:
        """The loop drives the torch runtime's Runner directly (forward on device ids, its paged
        cache's plan / wrote); llama.cpp's runner takes whole token lists only."""
        return callable(getattr(runner, "forward", None)) and hasattr(getattr(runner, "cache", None), "wrote")

    @torch.inference_mode()
    def draft(self, rows: list[Row], views: list[RowTokens], held: list[int], floors) -> tuple[list[list[int]], int]:
        """Each row's drafts (up to its k) and the drafter forwards taken. rows: k >= 1 each;
        views: their tokens (RowTokens); held: the tokens each row's cache holds of them
        (KVCache.valid); floors(rows): each row's confidence floor."""
        runner, cache = self.runner, self.runner.cache
        B, ks, keys = len(rows), [r.k for r in rows], [r.key for r in rows]
        K = max(ks)
        width = self._catch_up(keys, views, held)
        # Blocks for each row's tokens and k - 1 fed drafts (placeholders: plan compares and
        # hashes only the tokens before the limit, which are the row's own)
        reserve = [RowTokens(v.base, list(v.extra) + [0] * (k - 1), v.final) for v, k in zip(views, ks)]
        plans = cache.plan(keys, reserve, [len(v) - width for v in views])
        seqs = [s for s, _ in plans]
        starts = torch.tensor([st for _, st in plans])  # each row's len - width
        ids = torch.tensor([v[len(v) - width :] for v in views])  # [B, width]
        at = "all" if width == 1 else torch.full((B, 1), width - 1)
        logits = runner.forward(seqs, starts, ids, at)  # [B, 1, V]
        drafts, count = self._steps(rows, views, ks, K, seqs, starts + width, logits, floors(rows))
        drafts, count = to_host(drafts, count)  # the loop's one read
        out = [drafts[b, : int(count[b])].tolist() for b in range(B)]
        for b, (s, start) in enumerate(plans):  # what the steps fed: the last tokens, then drafts
            cache.wrote(s, views[b][start:] + out[b][:-1])
        return out, K

    def _catch_up(self, keys: list[str], views: list[RowTokens], held: list[int]) -> int:
        """The first step's width: the rows' longest lag (tokens a cache lacks), at most MAX_WIDTH
        and the shortest row's length; the rows lagging more are fed up to it now, together, in
        one forward without logits."""
        lags = [len(v) - h for v, h in zip(views, held)]
        width = max(1, min(max(lags), MAX_WIDTH, min(len(v) for v in views)))
        behind = [b for b, lag in enumerate(lags) if lag > width]
        if behind:
            heads = [views[b][: len(views[b]) - width] for b in behind]
            self.runner.feed([keys[b] for b in behind], heads, logits=False, protect=keys)
        return width

    def _steps(self, rows, views, ks, K, seqs, next_start, logits, floors):
        """The K steps on the device: drafts [B, K] and each row's count [B], no host read. Without
        a confidence floor a row's count is its k (host-known): only the tokens are computed."""
        runner, V = self.runner, self.vocab_size
        dev = logits.device
        sampled = [b for b, r in enumerate(rows) if r.sampled]
        keys = self.keys.tensor([rows[b] for b in sampled], 1, dev) if sampled else None
        # the sampled rows' draft 0's position
        first = torch.tensor([rows[b].start + len(views[b]) for b in sampled]).to(dev) if sampled else None
        judge = any(f > 0 for f in floors)
        if judge:
            active = (torch.arange(K)[None, :] < torch.tensor(ks)[:, None]).to(dev)  # [B, K]: j < k_b
            floor = torch.tensor(floors, dtype=torch.float32, device=dev)
            count = torch.zeros(len(rows), dtype=torch.long, device=dev)
            alive = torch.ones(len(rows), dtype=torch.bool, device=dev)
        tokens = []
        for j in range(K):
            x = logits[:, 0, :V]  # [B, V]: predicts each row's draft j
            tok = argmax(x)
            if sampled:
                p = probs_rows(x[sampled][:, None], [rows[b] for b in sampled])[:, 0]
                tok[sampled] = keyed_draw(p, keys, first + j)
            tokens.append(tok)
            if judge:  # drafters.stopping: the judged rows stop together when unsure
                live = alive & active[:, j]
                count += live
                conf = top_prob(x)
                judged = live & (floor > 0)
                unsure = (conf * judged).sum() < (floor * judged).sum()
                alive = alive & ~(judged & unsure)
            if j + 1 < K:
                logits = runner.forward(seqs, next_start + j, tok[:, None], "all")
        if not judge:
            count = torch.tensor(ks, device=dev)
        return torch.stack(tokens, 1), count
