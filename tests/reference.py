"""A plain scalar implementation of FLy's verification (the paper's Algorithm 1), one row at a
time, written for reading rather than speed: the batched code must agree with it."""


def fly_reference(drafts, y, h, n, theta, window, rule="paper"):
    """drafts[0..n-1] = d_1..d_n, y[0..n] the target's tokens, h[0..n-1] its entropies.

    Returns (emitted tokens, number of drafts kept, number loosely accepted)."""
    w = window - 1 if rule == "authors" else window
    w = max(w, 0)
    mismatch = [drafts[i] != y[i] for i in range(n)]
    loosely = 0
    for j in range(1, n + 1):  # 1-indexed positions, as in the paper
        if not mismatch[j - 1]:
            continue
        strict = theta >= 1 or h[j - 1] < theta
        window_clean = j + w <= n and not any(mismatch[j:j + w])
        if strict or not window_clean:
            return list(drafts[:j - 1]) + [y[j - 1]], j - 1, loosely
        loosely += 1
    return list(drafts[:n]) + [y[n]], n, loosely
