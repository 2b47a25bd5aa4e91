"""The target model as the round's scorer: one forward over [last token, d_1..d_K] for every
row, then the check next to the logits, so that only small [B, K] tensors leave (verify.py)."""

import torch

from fly_serve.contracts import Drafts, ModelRunner, Row, Verdict
from fly_serve.decision.grammar import apply_masks
from fly_serve.decision.sampling import Generators, keyed_row, probs, speculative_row
from fly_serve.decision.verify import entropy, greedy_check, padded, plausibility_from_logits, plausibility_from_probs


class ModelScorer:
    def __init__(self, runner: ModelRunner, vocab_size: int | None = None, topk: int = 8, sample: bool = True):
        """runner: the target with its KV cache (contracts.ModelRunner: runner.Runner or
        llama_runner.LlamaRunner)."""
        self.runner = runner
        self.kv_capacity_tokens = runner.cache.capacity_tokens  # the engine admits within it
        # The tokens the tokenizer knows: logits past them (padding rows of a wider head) are
        # cut, so target and drafter distributions always have the same width.
        self.vocab_size = vocab_size or runner.vocab_size
        self.generators = Generators(salt=2, device=runner.device)  # sampling stays by the logits
        # The target's likeliest tokens at every verified position go back in the Verdict for Token
        # Recycling: ids only, [B, K+1, topk] (0: not reported). A topk over the logits already
        # computed costs far less than the forward, and the batch's ids are a few KB.
        self.topk = topk
        # A tensor-parallel rank whose verdict nobody reads (every rank but 0) skips the sampling
        # rows' full-vocabulary work: its verdict has greedy checks only.
        self.sample = sample

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        keys = [r.key for r in rows]
        self.runner.catch_up(keys, [r.tokens for r in rows])
        seqs = [r.tokens + d for r, d in zip(rows, drafts.tokens)]
        logits, _ = self.runner.feed(keys, seqs, tail=[1 + len(d) for d in drafts.tokens])
        logits = logits[..., : self.vocab_size]
        # Token Recycling learns what the target predicts after a token in general: its top-k is
        # taken before the grammar's mask (under it, the -inf ids past the allowed few would be junk)
        top = logits.topk(min(self.topk, logits.shape[-1]), dim=-1).indices.cpu() if self.topk > 0 else None
        # Structured output: every read below (argmax, sampling, entropy, support) sees the
        # distribution the grammar allows
        apply_masks(logits, drafts.masks)
        drafted, n = padded(drafts.tokens)
        ok, y = greedy_check(logits, drafted, n)
        support = self._grammar_support(logits, drafted, drafts.masks)
        # The plausibility guard's ratio p(d) / max p, only in a round where some row has a guard
        # (the engine applies each row's rho): two gathers on the greedy logits and a copy to the
        # host, overwritten below for sampling rows.
        ratio = plausibility_from_logits(logits, drafted, y) if any(r.rho > 0 for r in rows) else None
        h = torch.zeros(drafted.shape) if any(r.entropy for r in rows) else None
        greedy_loose = [b for b, r in enumerate(rows) if r.entropy and not r.sampled]
        for kind in {rows[b].entropy for b in greedy_loose}:
            idx = [b for b in greedy_loose if rows[b].entropy == kind]
            h[idx] = entropy(torch.softmax(logits[idx, :-1].float(), -1), kind).cpu()
        for b, r in enumerate(rows):
            if r.sampled and self.sample:  # on the logits' device: only [K]-sized results reach the host
                nb = int(n[b])
                p = probs(logits[b, : nb + 1], r.temperature, r.top_p)  # [n+1, V]
                ok[b], y[b] = self._sample_row(r, p, drafted[b], nb, drafts.q[b])
                d = drafted[b, :nb].to(p.device)
                support[b, :nb] = (p[torch.arange(nb, device=p.device), d] > 0).cpu()
                if ratio is not None:
                    ratio[b, :nb] = plausibility_from_probs(p[:-1], d).cpu()
                if r.entropy:
                    h[b, :nb] = entropy(p[:-1], r.entropy).cpu()
        hits = self.runner.cache.take_hits(keys)  # prefill the prefix cache saved, per row
        return Verdict(ok, y, h, support, top, plausibility=ratio, prefix_hit_tokens=hits)

    def _sample_row(self, r: Row, p: torch.Tensor, drafted: torch.Tensor, n: int, q: torch.Tensor | None):
        """Speculative sampling of one row. Deterministic drafts (q None) of a strict row draw by
        position (sampling.keyed_row: the text of a seeded request then does not depend on what
        the drafts were); a drafter's sampled q, or a row whose FLy window reads later positions
        to decide an earlier one, draws from the row's stream."""
        if q is None and not r.entropy:
            start = r.start + len(r.tokens)  # the sequence position of p[0]'s token
            return keyed_row(p, drafted, n, lambda i: self.generators.at(r, start + i))
        return speculative_row(p, drafted, n, q, self.generators.get(r))

    @staticmethod
    def _grammar_support(logits: torch.Tensor, drafted: torch.Tensor, masks) -> torch.Tensor:
        """[B, K]: False where a row's grammar refuses its draft (never loosely accepted), read off
        the masked logits (apply_masks already put -inf there); all True without a grammar."""
        if not any(m is not None for m in masks or []):
            return torch.ones(drafted.shape, dtype=torch.bool)
        at = logits[:, : drafted.shape[1]].gather(-1, drafted.to(logits.device)[..., None]).squeeze(-1)
        return (at > float("-inf")).cpu()

    def release(self, keys: list[str]) -> None:
        self.runner.release(keys)
        self.generators.release(keys)
