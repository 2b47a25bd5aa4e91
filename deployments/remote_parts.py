"""The engine's parts as calls to deployments: RemoteScorer satisfies contracts.Scorer,
RemoteDrafter and RemoteLookup contracts.Drafter, so the ingress's Engine runs its rounds
unchanged while drafting and verification run in their own replicas. Called from the engine
thread (not an event loop), so the blocking `.result()` is fine there."""

import zlib

from fly_serve.contracts import Drafts, Row, Verdict


class RemoteScorer:
    def __init__(self, handle, vocab_size: int):
        self.handle, self.vocab_size = handle, vocab_size

    def verify(self, rows: list[Row], drafts: Drafts) -> Verdict:
        return self.handle.verify.remote(rows, drafts).result()

    def release(self, keys: list[str]) -> None:
        self.handle.release.remote(keys).result()


def group_of(key: str, n_groups: int) -> int:
    """Stable across processes and restarts (unlike hash(), which is salted per process)."""
    return zlib.crc32(key.encode()) % n_groups


class RemoteDrafter:
    """Splits a round's rows into affinity groups; each group is one call tagged with
    multiplexed_model_id "g<n>", so Serve sends it to the replica that served the group before
    (and holds those rows' KV caches). The group calls run concurrently."""

    def __init__(self, handle, n_groups: int = 1):
        self.handle, self.n_groups = handle, n_groups

    def _split(self, keys: list[str]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(group_of(key, self.n_groups), []).append(i)
        return groups

    def _for(self, group: int):
        return self.handle.options(multiplexed_model_id=f"g{group}")

    def propose(self, rows: list[Row]) -> Drafts:
        groups = self._split([r.key for r in rows])
        calls = {g: self._for(g).propose.remote([rows[i] for i in idx]) for g, idx in groups.items()}
        out = Drafts.empty(len(rows))
        for g, idx in groups.items():
            got = calls[g].result()
            for j, i in enumerate(idx):
                out.tokens[i], out.q[i] = got.tokens[j], got.q[j]
        return out

    def release(self, keys: list[str]) -> None:
        groups = self._split(keys)
        calls = [self._for(g).release.remote([keys[i] for i in idx]) for g, idx in groups.items()]
        for call in calls:
            call.result()


class RemoteLookup:
    """Prompt lookup through the lookup deployment (app built with pld="deployment")."""

    def __init__(self, handle):
        self.handle = handle

    def propose(self, rows: list[Row]) -> Drafts:
        return self.handle.propose.remote(rows).result()

    def release(self, keys: list[str]) -> None:
        pass  # prompt lookup keeps no per-sequence state
