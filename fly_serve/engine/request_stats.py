"""One request's counters, in the vocabulary of verify.py, and the paper's Table 1 time split."""

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    rounds: int = 0
    emitted: int = 0  # tokens that reached the output (after max_tokens / EOS cuts)
    drafted: int = 0
    accepted: int = 0
    loosely_accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    draft_s: float = 0.0  # time of the rounds this request took part in, by phase
    verify_s: float = 0.0
    decide_s: float = 0.0
    # draft-ahead (draft_ahead.py): the bets on this request's rounds won (its next drafts were made
    # while the round was verified) and lost, the drafts thrown away with the lost ones, and how
    # long the drafter waited for the verdict / the verdict for the ahead drafts, summed
    ahead_hits: int = 0
    ahead_misses: int = 0
    ahead_dropped: int = 0
    verify_wait_s: float = 0.0
    draft_wait_s: float = 0.0
    # position in the output tokens (0-based) of the first loosely accepted draft that reached the
    # output; None: none did
    first_loose_pos: int | None = None
    # prompt tokens taken from the prefix cache instead of prefilled (kv_cache.py): target, drafter
    prefix_hit_tokens: int = 0
    draft_prefix_hit_tokens: int = 0
    # structured output: drafts the engine cut because the grammar refused them (or a draft before
    # them); a drafter that drafts under the grammar leaves only model-free proposals to cut
    grammar_cut: int = 0
    # per drafter (a model drafter's name, or a model-free source's kind): its drafts and the
    # drafts of them kept (accepted + loosely accepted)
    by_drafter: dict = field(default_factory=dict)

    def add_round(self, drafted: int, accepted: int, loosely: int, round_) -> None:
        """Count one round: `accepted` exact and `loosely` kept of `drafted` drafts; round_ gives
        the round's phase times (contracts.RoundResult)."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.loosely_accepted += loosely
        kept = accepted + loosely
        self.recovered += kept < drafted
        self.bonus += kept == drafted > 0
        self.draft_s += round_.draft_s
        self.verify_s += round_.verify_s
        self.decide_s += round_.decide_s
        self.verify_wait_s += round_.verify_wait_s
        self.draft_wait_s += round_.draft_wait_s

    def add_source(self, source: str, drafted: int, kept: int) -> None:
        counts = self.by_drafter.setdefault(source, {"drafted": 0, "kept": 0})
        counts["drafted"] += drafted
        counts["kept"] += kept

    def add_prefix_hits(self, target: int, drafter: int) -> None:
        self.prefix_hit_tokens += target
        self.draft_prefix_hit_tokens += drafter

    def note_loose(self, emitted_before: int, loosely, committed: int) -> None:
        """Record where the first loose accept sits: `loosely` [K] marks this round's loosely kept
        drafts (draft i is output token emitted_before + i); only the `committed` tokens that
        reached the output count (an EOS or max_tokens cut drops the rest)."""
        if self.first_loose_pos is not None:
            return
        kept = [i for i, loose in enumerate(loosely.tolist()) if loose and i < committed]
        if kept:
            self.first_loose_pos = emitted_before + kept[0]

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round (the paper's acceptance length)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tau"] = round(self.tau, 3)
        for key in ("draft_s", "verify_s", "decide_s", "verify_wait_s", "draft_wait_s"):
            d[key] = round(d[key], 4)
        return d
