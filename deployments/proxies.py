"""Stand-ins for a Target / drafter inside the ingress's Engine: same methods, but each call goes
to a deployment through its handle. Called from the engine thread (not an event loop), so the
blocking `.result()` is fine there."""
import zlib


class TargetProxy:
    def __init__(self, handle):
        self.handle = handle

    def score(self, rows, drafts, qs, entropy_kinds):
        return self.handle.score.remote(rows, drafts, qs, entropy_kinds).result()

    def release(self, keys):
        self.handle.release.remote(keys).result()


def group_of(key: str, n_groups: int) -> int:
    """Stable across processes and restarts (unlike hash(), which is salted per process)."""
    return zlib.crc32(key.encode()) % n_groups


class DrafterProxy:
    """Splits a round's rows into affinity groups; each group is one call tagged with
    multiplexed_model_id "g<n>", so Serve sends it to the replica that served the group before
    (and holds those rows' KV caches). The group calls run concurrently."""

    def __init__(self, handle, n_groups: int = 1):
        self.handle, self.n_groups = handle, n_groups

    def _split(self, keys):
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(group_of(key, self.n_groups), []).append(i)
        return groups

    def _for(self, group: int):
        return self.handle.options(multiplexed_model_id=f"g{group}")

    def propose(self, rows):
        groups = self._split([r.key for r in rows])
        calls = {g: self._for(g).propose.remote([rows[i] for i in idx]) for g, idx in groups.items()}
        drafts, qs = [None] * len(rows), [None] * len(rows)
        for g, idx in groups.items():
            d, q = calls[g].result()
            for i, di, qi in zip(idx, d, q):
                drafts[i], qs[i] = di, qi
        return drafts, qs

    def release(self, keys):
        groups = self._split(keys)
        calls = [self._for(g).release.remote([keys[i] for i in idx]) for g, idx in groups.items()]
        for call in calls:
            call.result()


class PLDProxy:
    """Prompt lookup through the PLD deployment (app built with pld="deployment")."""

    def __init__(self, handle):
        self.handle = handle

    def propose(self, rows):
        return self.handle.propose.remote(rows).result()

    def release(self, keys):
        pass  # PLD keeps no per-sequence state
