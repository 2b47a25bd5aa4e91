"""The target model as the round's scorer: one forward over [last token, d_1..d_K] for every
row, then the check next to the logits, so that only small [B, K] tensors leave (verify.py),
in one copy to the host (host.to_host): a verification reads the device once, however many rows
sample (sampling.py: keyed draws, batched) or decide loosely."""

import torch

from fly_serve.contracts import Drafts, ModelRunner, Row, RowTokens, Verdict
from fly_serve.decision.grammar import apply_masks
from fly_serve.decision.host import to_host
from fly_serve.decision.sampling import Generators, RowKeys, keyed_draw, probs, probs_rows, speculative_row
from fly_serve.decision.verify import padded, plausibility_from_logits, plausibility_from_probs
from fly_serve.decision.vocab_reads import argmax, entropy, gate_entropy


class ModelScorer:
    def __init__(self, runner: ModelRunner, vocab_size: int | None = None, topk: int = 1, sample: bool = True):
        """runner: the target with its KV cache (contracts.ModelRunner: runner.Runner or
        llama_runner.LlamaRunner)."""
        self.runner = runner
        self.kv_capacity_tokens = runner.cache.capacity_tokens  # the engine admits within it
        # The tokens the tokenizer knows: logits past them (padding rows of a wider head) are
        # cut, so target and drafter distributions always have the same width.
        self.vocab_size = vocab_size or runner.vocab_size
        # Sampled rows draw keyed (sampling.keyed_draw: the drafter shares the numbers); a row whose
        # drafter shipped its q is verified against it from the row's own generator.
        self.keys = RowKeys()
        self.generators = Generators(salt=2, device=runner.device)
        # The target's likeliest tokens at every verified position go back in the Verdict for Token
        # Recycling: ids only, [B, K+1, topk] (0: not reported). It proposes the top-1 chain only,
        # and the top-1 is the argmax the check computes anyway: 1 costs nothing, where a top-k
        # over the vocabulary at every position of every round is work a plain row never needs.
        self.topk = topk
        # A tensor-parallel rank whose verdict nobody reads (every rank but 0) skips the sampling
        # rows' full-vocabulary work: its verdict has greedy checks only.
        self.sample = sample

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        keys = [r.key for r in rows]
        self.runner.catch_up(keys, [RowTokens.of(r) for r in rows])
        seqs = [RowTokens.of(r, d) for r, d in zip(rows, drafts.tokens)]
        logits, _ = self.runner.feed(keys, seqs, tail=[1 + len(d) for d in drafts.tokens])
        logits = logits[..., : self.vocab_size]  # [B, K+1, V]
        if self.plain(rows, drafts):
            return self._plain_verdict(keys, logits)
        dev = logits.device
        # Token Recycling learns what the target predicts after a token in general: its top-k is
        # taken before the grammar's mask (under it, the -inf ids past the allowed few would be junk)
        masked = any(m is not None for m in drafts.masks or [])
        ranked = self.topk > 1 or (self.topk == 1 and masked)
        top = logits.topk(min(self.topk, logits.shape[-1]), dim=-1).indices if ranked else None
        # Structured output: every read below (argmax, sampling, entropy, support) sees the
        # distribution the grammar allows
        apply_masks(logits, drafts.masks)
        drafted, n = padded(drafts.tokens)  # [B, K], [B] on the host
        K = drafted.shape[1]
        d = drafted.to(dev)
        y = argmax(logits)  # [B, K+1]: greedy rows' tokens; sampled rows' are drawn below
        if self.topk == 1 and top is None:  # the top-1 is the argmax (no mask), taken before draws overwrite y
            top = y[..., None].clone()
        keyed = [b for b, r in enumerate(rows) if r.sampled and self.sample and drafts.q[b] is None]
        # support: None where nothing can refuse a draft (no grammar, no sampled row: all True)
        support = self._grammar_support(logits, d, drafts.masks, always=bool(keyed))
        # The plausibility guard's ratio p(d) / max p, only in a round where some row has a guard
        # (the engine applies each row's rho); sampled rows' from their processed distribution.
        ratio = plausibility_from_logits(logits, d, y) if K and any(r.rho > 0 for r in rows) else None
        h = torch.zeros(drafted.shape, device=dev) if K and any(r.entropy for r in rows) else None
        greedy_loose = [b for b, r in enumerate(rows) if r.entropy and not r.sampled] if h is not None else []
        for kind in {rows[b].entropy for b in greedy_loose}:
            gate_entropy(logits, d, y, n, [b for b in greedy_loose if rows[b].entropy == kind], kind, h)
        if keyed:
            self._draw_keyed([rows[b] for b in keyed], keyed, logits, d, y, support, ratio, h)
        y, h, support, top, ratio = to_host(y, h, support, top, ratio)  # the round's one read
        ok = (drafted == y[:, :K]) & (torch.arange(K)[None, :] < n[:, None])  # [B, K], on the host
        if support is None:
            support = torch.ones(drafted.shape, dtype=torch.bool)
        for b, r in enumerate(rows):  # a drafter's own q: speculative sampling (sampling.py)
            if r.sampled and self.sample and drafts.q[b] is not None:
                self._speculative_row(r, b, logits, drafted, int(n[b]), drafts.q[b], ok, y, support, ratio, h)
        hits = self.runner.cache.take_hits(keys)  # prefill the prefix cache saved, per row
        return Verdict(ok, y, h, support, top, plausibility=ratio, prefix_hit_tokens=hits)

    def plain(self, rows: list[Row], drafts: Drafts) -> bool:
        """A round whose every row decodes plainly and greedily: no drafts, no grammar, no draw
        (what the checks below would compute from it is the argmax alone)."""
        return (
            self.topk == 1
            and not any(drafts.tokens)
            and not any(m is not None for m in drafts.masks or [])
            and not any(r.sampled and self.sample for r in rows)
        )

    def _plain_verdict(self, keys: list[str], logits: torch.Tensor) -> Verdict:
        """A plain round's verdict: the argmax, and the general path's tensors of no drafts. Its
        own path because a plain step's host work runs on caches the forward has just swept:
        each small tensor op of the general path cost ~10x its warm time there (docs/journal.md,
        "Host work of a plain step")."""
        y = argmax(logits).cpu()  # [B, 1]: the round's one read
        none = torch.zeros(y.shape[0], 0, dtype=torch.bool)  # [B, 0]
        hits = self.runner.cache.take_hits(keys)
        return Verdict(none, y, None, torch.ones_like(none), y[..., None], prefix_hit_tokens=hits)

    def _draw_keyed(self, rows: list[Row], idx: list[int], logits, d, y, support, ratio, h) -> None:
        """The sampled rows' tokens, all at once on the logits' device: each position's keyed
        draw from the processed distribution (sampling.keyed_draw); the support, ratio and
        entropy those rows' decisions read, from the same distribution (in place)."""
        dev, T = logits.device, logits.shape[1]
        p = probs_rows(logits[idx], rows)  # [R, K+1, V]
        first = torch.tensor([r.start + len(r.tokens) for r in rows], dtype=torch.long)  # p[:, 0]'s position
        positions = (first[:, None] + torch.arange(T)[None, :]).reshape(-1).to(dev)
        keys = self.keys.tensor(rows, T, dev)
        y[idx] = keyed_draw(p.reshape(-1, p.shape[-1]), keys, positions).view(len(rows), T)
        K = d.shape[1]
        at = p[:, :K].gather(-1, d[idx][..., None]).squeeze(-1)  # [R, K]: p of each draft
        support[idx] = support[idx] & (at > 0)
        if ratio is not None:
            ratio[idx] = at / p[:, :K].amax(-1)
        if h is not None:
            for kind in {r.entropy for r in rows if r.entropy}:
                sel = [i for i, r in enumerate(rows) if r.entropy == kind]
                h[[idx[i] for i in sel]] = entropy(p[sel, :K], kind)

    def _speculative_row(self, r: Row, b: int, logits, drafted, n: int, q, ok, y, support, ratio, h) -> None:
        """A row whose drafter shipped its q: standard speculative sampling from the row's own
        generator (its text then depends on the drafts); host results written in place."""
        p = probs(logits[b, : n + 1], r.temperature, r.top_p)  # [n+1, V]
        ok[b], y[b] = speculative_row(p, drafted[b], n, q, self.generators.get(r))
        dd = drafted[b, :n].to(p.device)
        at = p[torch.arange(n, device=p.device), dd]
        support[b, :n] = support[b, :n] & (at > 0).cpu()
        if ratio is not None:
            ratio[b, :n] = plausibility_from_probs(p[:-1], dd).cpu()
        if r.entropy:
            h[b, :n] = entropy(p[:-1], r.entropy).cpu()

    @staticmethod
    def _grammar_support(logits: torch.Tensor, drafted: torch.Tensor, masks, always: bool) -> torch.Tensor | None:
        """[B, K] on the logits' device: False where a row's grammar refuses its draft (never
        loosely accepted), read off the masked logits (apply_masks already put -inf there); all
        True without a grammar (None unless `always`: the caller makes it on the host)."""
        if not any(m is not None for m in masks or []):
            return torch.ones(drafted.shape, dtype=torch.bool, device=logits.device) if always else None
        at = logits[:, : drafted.shape[1]].gather(-1, drafted[..., None]).squeeze(-1)
        return at > float("-inf")

    def release(self, keys: list[str]) -> None:
        self.runner.release(keys)
        self.generators.release(keys)
        self.keys.release(keys)
