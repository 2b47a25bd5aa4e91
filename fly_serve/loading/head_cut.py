"""A drafter's lm_head cut to the tokens it may usefully propose.

The 0.5B drafter's lm_head (151,936 x 896) is about a quarter of its weights, and every drafted
token pays for all of it. Byte-level BPE ids are merge ranks: a low id is a merge learned early,
i.e. a piece frequent in the tokenizer's training corpus, so "ids below N" keeps the pieces a
drafter most often gets right, at no corpus cost. The tokenizer's added tokens (EOS, chat and FIM
markers) are kept too, whatever their id.

The cut head still returns logits of full width, -inf outside the kept set: the drafter's q stays
a distribution over the whole vocabulary (zero off the set) and nothing downstream changes. The
target verifies over the full vocabulary, so outputs stay the target's; a cut only costs the
drafts whose token falls outside the set.
"""

import torch
from torch import nn


def check_head_cut(value, field: str = "head_cut") -> int | None:
    """`value` if it is None or a positive int (not a bool), else a ValueError naming `field`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{field}: must be a positive number of token ids or None (got {value!r})")
    return value


def kept_ids(n: int, width: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """Sorted LongTensor of ids below n plus `always` (ids past `width` dropped)."""
    if check_head_cut(n) is None:
        raise ValueError("head_cut: a cut needs a number of token ids (got None)")
    ids = set(range(min(n, width))) | {int(i) for i in always if 0 <= int(i) < width}
    return torch.tensor(sorted(ids), dtype=torch.long)


class CutHead(nn.Module):
    """lm_head restricted to `keep` rows; returns full-width logits, -inf off the set.

    The kept rows are a plain nn.Linear (`self.proj`), so quantizing the model afterwards
    quantizes it like any other Linear."""

    def __init__(self, head: nn.Linear, keep: torch.Tensor):
        super().__init__()
        self.width = head.out_features
        self.proj = nn.Linear(head.in_features, len(keep), bias=head.bias is not None)
        self.proj.to(head.weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight[keep])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias[keep])
        self.proj.requires_grad_(False)
        self.register_buffer("keep", keep.clone(), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.proj(x)
        # One fill and one scatter of the kept columns: cheap next to the rows it saves.
        out = small.new_full((*small.shape[:-1], self.width), float("-inf"))
        return out.index_copy_(out.dim() - 1, self.keep, small)


def cut_head(model, n: int, always=()) -> nn.Module:
    """Replace model.lm_head (in place) by its rows for ids below n plus `always`; returns the model.

    An lm_head tied to the input embeddings is untied first (the embeddings keep every row)."""
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise ValueError(f"head_cut: lm_head must be a torch.nn.Linear to cut (got {type(head).__name__})")
    keep = kept_ids(n, head.out_features, always)
    model.lm_head = CutHead(head, keep)
    # Tied weights would make transformers re-tie lm_head.weight on save/load; there is none now.
    model.config.tie_word_embeddings = False
    return model
