"""The target side of a round: one forward over [last token, d_1..d_K] for every row, then
score() next to the logits, so that only small [B, K] tensors leave (see verify.py)."""
import torch

from .rows import Generators, Row
from .runner import Runner
from .verify import entropy, padded, score


class Target:
    def __init__(self, model, n_slots: int = 8, tp_group=None):
        self.runner = Runner(model, n_slots=n_slots, tp_group=tp_group)
        self.generators = Generators(salt=2)

    def score(self, rows: list[Row], drafts: list[list[int]], qs, entropy_kinds):
        """drafts[b]: row b's drafts; qs[b]: their q [n, V] or None; entropy_kinds[b]: the gate's
        entropy for row b, None where the row cannot defer. Returns ok, y, h (verify.score)."""
        keys = [r.key for r in rows]
        self.runner.catch_up(keys, [r.tokens for r in rows])
        seqs = [r.tokens + d for r, d in zip(rows, drafts)]
        logits, _ = self.runner.feed(keys, seqs, tail=[1 + len(d) for d in drafts])
        drafted, n = padded(drafts)
        sampled = [(b, qs[b], r.temperature, r.top_p, self.generators.get(r))
                   for b, r in enumerate(rows) if r.sampled]
        ok, y = score(logits, drafted, n, sampled)
        h = None
        for kind in set(entropy_kinds) - {None}:
            if h is None:
                h = torch.zeros(drafted.shape)
            of_kind = torch.tensor([e == kind for e in entropy_kinds])
            h[of_kind] = entropy(logits[of_kind.to(logits.device), :-1], kind).cpu()
        return ok, y, h

    def release(self, keys):
        self.runner.release(keys)
        self.generators.release(keys)

