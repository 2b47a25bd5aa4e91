"""A plain scalar implementation of FLy's verification (the paper's Algorithm 1), one row at a
time, written for reading rather than speed: the batched code must agree with it."""


def fly_reference(drafts, y, h, n, theta, window, rule="paper", support=None, p=None, rho=0.0):
    """drafts[0..n-1] = d_1..d_n, y[0..n] the target's tokens, h[0..n-1] its entropies,
    support[0..n-1] whether the target gives the draft token p > 0 (default: everywhere),
    p[0..n-1] the target's distribution at each position (weights over the vocabulary; the rule
    is scale-free) for the plausibility guard: a mismatch is deferred only where
    p(d_j) >= rho * max p (default: no guard).

    The window checks W positions after a mismatch (the authors' code: W - 1) and must end inside
    the drafts: j + W <= n under both rules.
    Returns (emitted tokens, number of drafts kept, number loosely accepted)."""
    checked = max(window - 1, 0) if rule == "authors" else window
    mismatch = [drafts[i] != y[i] for i in range(n)]
    loosely = 0
    for j in range(1, n + 1):  # 1-indexed positions, as in the paper
        if not mismatch[j - 1]:
            continue
        strict = theta >= 1 or h[j - 1] < theta or (support is not None and not support[j - 1])
        implausible = p is not None and p[j - 1][drafts[j - 1]] < rho * max(p[j - 1])
        window_clean = j + window <= n and not any(mismatch[j : j + checked])
        if strict or implausible or not window_clean:
            return list(drafts[: j - 1]) + [y[j - 1]], j - 1, loosely
        loosely += 1
    return list(drafts[:n]) + [y[n]], n, loosely
