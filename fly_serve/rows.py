"""What the engine sends to a drafter or a target for one round: one Row per sequence.

Rows carry the whole token list, so a drafter or target replica that has never seen the
sequence (or saw an older state) rebuilds what it needs; see kv_cache.KVCache.plan.
"""
from dataclasses import dataclass

import torch


@dataclass
class Row:
    key: str  # the request's id: names its KV-cache slot and its random generator
    tokens: list[int]  # prompt + generated so far
    k: int = 0  # drafts wanted this round (0: plain decoding)
    mla: bool = True  # model drafter: prompt lookup proposals verified by the drafter
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


class Generators:
    """One torch.Generator per sequence, so a seeded request draws the same numbers whatever
    else shares its batch. `salt` keeps the drafter's stream apart from the target's."""

    def __init__(self, salt: int):
        self.salt, self.by_key = salt, {}

    def get(self, row: Row) -> torch.Generator:
        if row.key not in self.by_key:
            g = torch.Generator()
            if row.seed is None:
                g.seed()
            else:
                g.manual_seed(row.seed * 1000003 + self.salt)
            self.by_key[row.key] = g
        return self.by_key[row.key]

    def release(self, keys):
        for key in keys:
            self.by_key.pop(key, None)
