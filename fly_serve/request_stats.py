"""One request's counters, in the vocabulary of verify.py, and the paper's Table 1 time split."""

from dataclasses import asdict, dataclass


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

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round (the paper's acceptance length)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tau"] = round(self.tau, 3)
        for key in ("draft_s", "verify_s", "decide_s"):
            d[key] = round(d[key], 4)
        return d
