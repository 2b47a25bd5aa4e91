"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from max_n down to min_n). No model, a few microseconds."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens, k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens; fewer when the match lies near the end, none when nothing matches."""
    if k <= 0 or len(tokens) < 2:
        return []
    seq = np.asarray(tokens)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        # Windows over seq[:-1] start at 0 .. len-1-n: the suffix cannot match itself.
        windows = sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: recent text repeats most
            return seq[start : start + k].tolist()
    return []
