"""k "auto": what the engine calls each round to get every row's k, and after it to report.

The parts, one job each:
  acceptance.py   AcceptanceTracker: each row's chance a draft is kept, from its own rounds
  round_cost.py   CostProfile (the measurement) and RoundCostModel (frozen predictions)
  allocator.py    plan: the ks of one round for the most expected tokens per predicted second
  measured_cost.py  the frozen profile against live rounds: CostCheck (a profile whose shape
                  they contradict is replaced), UnderLoad (rounds of two rows or more: the
                  drafter and the width priced as they measure them)
  cost_calibration.py  measures a profile where the engine runs (cached per machine and models)

Determinism. A row alone is planned from the frozen cost model and its own acceptance history,
and its probes (below) fall on its own round count: a greedy request sent alone twice gets the
same ks round by round, whatever the clock measured. For a row alone only a new profile changes
plans: an explicit recalibration (set_profile), or the cost check, which runs only while the
profile was not measured where the engine runs (the uncalibrated default shape, or a profile
given from elsewhere) and replaces it at most once. A profile measured here (cost_calibration.py)
is frozen for the engine's life: its shape may differ from live rounds by more than the check's
tolerance (short timing rows against long contexts), and a correction mid-service would change
the plan, hence the text, of the next identical request.

Under load. Rounds of two rows or more are planned from UnderLoad's model (measured_cost.py): the
frozen one with the drafter's forwards and rounds priced against the target, and the target's
width against its base, as the rounds under load measure them. There
the profile's error is as large as the differences between plans (a served ingress streams text
while the drafter runs), and a batch's text already depends on its other rows (the bf16 target
rounds a wider forward otherwise). To read the price of width UnderLoad needs consecutive
rounds of two widths, and a plan in steady state keeps one: so every `width_every`-th round of
two rows or more (with a batch table to price it), the rows at the plan's widest model-drafter k
draft one more, and the next time one fewer (a width step; the plan's k's neighbours are what
the plan weighs it against, so a step costs little where the plan is right).

Several drafters. An engine with more than one model drafter (each a model of its own, maybe of
another tokenizer: drafting/cross_vocab.py) lets k auto choose a row's drafter each round, among
those the row may use (RowInfo.drafters): each drafter keeps the row's acceptance apart
(drafter_key) and has its own draft costs (the profile's `drafters`, measured at calibration), so
the row drafts with the one whose plan alone has the best rate, that drafter's catch-up of the
row's tokens it has not seen included (RowInfo.drafter_lags), and its free drafts still compete
with it (_best_sources). The drafters a row does not use age back towards the prior, as its free
drafts do, so a drafter written off is tried again. A round whose rows use several drafters is
planned with the costs of the drafter most of them use; the cost check and UnderLoad (which price
the default drafter) learn only from rounds drafted by the default drafter alone.

The drafter's catch-up. A model row the drafter has not seen lately (RowInfo.drafter_lag) makes
it prefill those tokens before it drafts, which the plan does not price; the plan keeps such rows'
drafts only if what it saves over their decoding plainly, over the tokens the rows may still emit
(RowInfo.remaining), pays for that prefill (_catch_up_paid). Otherwise they decode plainly, and a
probe brings the drafter back within its budget.

Exploration. A row the plan leaves at k = 0 for `probe_every` rounds in a row (with a frozen profile,
a gap that doubles after each probe that did not pay, up to max_probe_every, and at least long
enough that probes cost `probe_budget` of the time, the drafter's catch-up of the tokens it missed
included: RoundCostModel.catch_up_s) gets a probe round
(with no early stop; at most `max_probes` rows a round): its acceptance is measured again, and the
cost check sees a drafting round, so a wrong seed (a profile that overprices drafting) corrects
itself within a few probes, and a row that was written off is tried again. A row alone probes
min(probe_k, its cap) drafts. In a batch a probe is paid by every row: the target verifies
[B, max k + 1], so a probe wider than the plan widens all B rows, and each of its drafts past the
plan's adds a drafter forward. So there a probe rides at the plan's widest model-drafter k (a row
below it verifies for free, in forwards the drafter runs anyway), and where the plan runs no
drafter forward (plain decoding, or only lookup drafts) it drafts 1 and the batch probes at most
once every probe_every + 1 rounds. (Before, a batch of 8 rows planned at k = 0 probed a row at
k = 4 every round once the rows were due: each round then verified [8, 5] and ran 4 drafter
forwards, about twice an ar round, for one row's measurement.)
"""

import copy
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, replace

from .acceptance import AcceptanceTracker
from .allocator import Plan, RowInfo, min_confidence_for, plan
from .lookup_match import match_prior
from .measured_cost import CostCheck, UnderLoad, point_of
from .round_cost import MODEL, NONE, PLD, CostProfile, RoundCostModel

log = logging.getLogger("fly_serve.k_auto.speculation_policy")


FREE = "\x00free"


def with_fields(r: RowInfo, **changes) -> RowInfo:
    """dataclasses.replace without running __init__ again (r's fields were checked when it was
    made): k auto copies every row's info every round, and replace's call costs ~10 us a row, a
    third of a millisecond a round at 16 rows (fly_bench/host_cost.py, the k-0 round)."""
    new = copy.copy(r)
    new.__dict__.update(changes)
    return new


DRAFTER = "\x00d:"
PLANS_KEPT = 8  # recent plans remembered by their inputs (SpeculationPolicy._plan)
ESTIMATE_DIGITS = 2  # a tracked acceptance or tokens per forward as the plan reads it (choose)
# The most a prompt lookup after a match shorter than its longest n-gram is priced at (a property of
# text, not of a machine): on the target's own greedy text of five of our prompts such matches kept
# their first draft 52% of the time (131 offers), 4-gram ones 83-98% on code and a rewrite
# (docs/journal.md, "Probes on a strong match"). The row's free estimate, learned mostly from its
# strong matches, would price them at that; where a wider verification costs little (a GPU), 0.5
# still drafts them.
SHORT_MATCH_ACCEPTANCE = 0.5


@dataclass
class RoundTrace:
    """What k auto learns from one finished round (SpeculationPolicy.record), per row: its key
    (free_key for a row that drafted from its free sources), drafts, kept (accepted + loosely
    accepted) and how it drafted (round_cost.KINDS; the caller says, since choose may not have
    run); and for the round: the drafter call's and the target call's seconds, the model
    drafter's forwards. row_forwards: per row, the drafter forwards it was in, if the drafter
    reports them (MLA's tokens per forward); ahead: per row, its drafts were made while the
    round before was verified (in neither this round's forwards nor its draft_s); prefilled: a
    row's prompt was prefilled in this round's forwards (UnderLoad skips the round)."""

    keys: list[str]
    drafted: list[int]
    kept: list[int]
    kinds: list[str]
    draft_s: float
    verify_s: float
    forwards: int = 0
    row_forwards: list[int] | None = None
    ahead: list[bool] | None = None
    prefilled: bool = False
    others: bool = False  # a model row drafted with a drafter other than the default (no cost check)


def free_key(key: str) -> str:
    """Where a model row's free drafts (RowInfo.free_k) keep their acceptance, apart from its
    model drafts: a prompt lookup is kept far more or less often than the drafter's guess."""
    return base_key(key) + FREE


def drafter_key(key: str, name: str | None, default: str | None) -> str:
    """Where a row's drafts by the named model drafter keep their acceptance: the row's own key
    for the default drafter, apart for each other one."""
    return base_key(key) if name is None or name == default else base_key(key) + DRAFTER + name


def base_key(key: str) -> str:
    """The row's own key of a free_key or drafter_key."""
    return key.split("\x00", 1)[0]


class SpeculationPolicy:
    """choose(rows) -> ks before a round: rows with fixed=True keep k_max but share the round
    (their drafts and forwards are paid before the others are chosen). record(...) after every
    round, whether or not choose ran. release(keys) when requests leave, so memory stays bounded
    by the running batch."""

    def __init__(
        self,
        cost: RoundCostModel | None = None,
        tracker: AcceptanceTracker | None = None,
        *,
        probe_every: int = 6,
        max_probe_every: int = 96,
        probe_budget: float = 0.05,
        free_probe_budget: float = 0.02,
        probe_k: int = 4,
        max_probes: int = 1,
        width_every: int = 6,
        check: CostCheck | None = None,
        under_load: UnderLoad | None = None,
    ):
        self.cost = cost or RoundCostModel()
        self.tracker = tracker or AcceptanceTracker()
        self.check = check if check is not None else CostCheck()
        self.under_load = under_load if under_load is not None else UnderLoad()
        self.probe_every, self.probe_k, self.max_probes = probe_every, probe_k, max_probes
        # A row's rounds between probes: probe_every; with a profile measured here (frozen, so the
        # probes only re-measure acceptance) doubled after each probe that left the plan at k = 0,
        # and at least as many as keep the probes' extra seconds at probe_budget of the time
        # (_budget_gap: where a drafter forward costs a good part of a target step, a probe costs
        # several plain rounds), up to max_probe_every; back to probe_every once the plan drafts it.
        self.max_probe_every = max(max_probe_every, probe_every)
        self.probe_budget = probe_budget
        # A row's free probes (_free_probes) spend less: a copy under way is priced from its
        # match's length without one (lookup_match.py), so they look only for what that misses
        # (a copy whose match is short yet); at 5% they cost 1-4% on prompts that copy nothing.
        self.free_probe_budget = free_probe_budget
        self._gap: dict[str, int] = {}
        self._priced: dict[str, int] = {}  # the budget's gap as last priced, per idle row (_due)
        self._plans: OrderedDict = OrderedDict()  # recent plans by their inputs (_plan)
        self.width_every = width_every
        self._batch_rounds = 0  # rounds of 2+ rows chosen (the width steps' clock)
        self.width_steps = 0  # rounds whose width was stepped since the start (the service's stats)
        self.frozen = False  # True: the cost check is off (a profile measured here, or corrected once)
        self.last: Plan | None = None  # the plan of the round last chosen (before probes)
        self.free: list[bool] = []  # per row of the round last chosen: it drafts from its free sources
        self._idle: dict[str, int] = {}  # rounds in a row the plan left each row at k = 0
        self._probing: set[str] = set()  # rows probed in the round last chosen
        self._batch_quiet = 0  # rounds of 2+ rows since a batch that planned no drafts probed
        self.probes = 0  # rows probed since the start (reported in the service's stats)
        # Draft-ahead (the engine sets it): a round costs max(draft, verify) plus the drafting of
        # the rows whose bet was lost (allocator.plan, round_cost.round_seconds).
        self.overlap = False
        # The engine's model drafters by name, the default first (set_drafters); per row of the
        # round last chosen, the drafter it drafts with (None: not a model row, or not chosen)
        self.drafter_names: tuple[str, ...] = ()
        self.drafter_of: list[str | None] = []
        self._drafter_costs: dict[str, RoundCostModel] = {}

    @classmethod
    def from_profile(cls, profile: CostProfile | dict | None, **tracker_kw) -> "SpeculationPolicy":
        return cls(RoundCostModel(profile), AcceptanceTracker(**tracker_kw))

    def set_drafters(self, names) -> None:
        """The engine's model drafters by name, the default first."""
        self.drafter_names = tuple(names)

    @property
    def default_drafter(self) -> str | None:
        return self.drafter_names[0] if self.drafter_names else None

    def key_of(self, key: str, drafter: str | None) -> str:
        return drafter_key(key, drafter, self.default_drafter)

    def cost_of(self, drafter: str | None, n_rows: int) -> RoundCostModel:
        """The cost model of a round of n_rows drafted by the named drafter: the default's
        (cost_for), or another's own draft costs on the same target curve."""
        if drafter is None or drafter == self.default_drafter or drafter not in self.profile.drafters:
            return self.cost_for(n_rows)
        if drafter not in self._drafter_costs:
            self._drafter_costs[drafter] = RoundCostModel(self.profile.for_drafter(drafter))
        return self._drafter_costs[drafter]

    def set_overlap(self, on: bool) -> None:
        """Draft-ahead on or off: a round then costs the longer of drafting and verifying."""
        self.overlap = on

    @property
    def profile(self) -> CostProfile:
        return self.cost.profile

    def set_profile(self, profile: CostProfile | dict, *, measured_here: bool = False) -> None:
        """Install a new cost profile (a recalibration): the only way plans change for the same
        request, besides the cost check. measured_here: timed on this engine's own parts, so
        frozen (the check stays off) until the next explicit call."""
        self.cost = RoundCostModel(profile)
        self._drafter_costs.clear()
        self.check.reset()
        self.under_load.reset()
        self.frozen = measured_here

    # ---- before a round
    def choose(self, rows: list[RowInfo]) -> list[int]:
        """Every row's k for this round; a row's unset acceptance and tokens per forward come from
        its own earlier rounds."""
        rows = [self._with_history(r, self.key_of(r.key, r.drafter)) for r in rows]
        rows = self._pick_drafters(rows)
        self.drafter_of = [r.drafter if r.source == MODEL else None for r in rows]
        cost = self.cost_of(self._round_drafter(rows), len(rows))
        self.last, rows, self.free = self._best_sources(rows, cost)
        self.last, rows = self._catch_up_paid(rows, self.last, cost)
        return self._probe(rows, self._step_width(rows, list(self.last.ks), cost))

    def _with_history(self, r: RowInfo, key: str | None = None) -> RowInfo:
        """The row (under `key`, if given) with its unset acceptance and tokens per forward from
        its key's rounds. A tracked estimate is a decayed count of a few drafts: read at two
        decimals, so that a round whose rows only aged (k 0 rows drifting back to the prior) is
        one the plan has seen (_plan remembers plans by their inputs)."""
        tracker, key = self.tracker, key or r.key
        return with_fields(
            r,
            key=key,
            acceptance=round(tracker.estimate(key), ESTIMATE_DIGITS) if r.acceptance is None else r.acceptance,
            tokens_per_forward=r.tokens_per_forward or round(tracker.tokens_per_forward(key), ESTIMATE_DIGITS),
        )

    def _pick_drafters(self, rows: list[RowInfo]) -> list[RowInfo]:
        """Each model row that may choose (RowInfo.drafters) with the drafter whose plan for the
        row alone has the best rate, from the row's acceptance with it, its costs and its
        catch-up (the tokens it has not seen of the row, prefilled before it drafts: a drafter
        the row left long ago pays for its whole gap in the round it drafts again). Plans that
        tie (all at k = 0: plain decoding beats every drafter now) go to the likeliest-kept
        drafter, so that the row's probes measure the one most likely to pay (then the first
        listed). One name: that drafter (the others are in their backoff)."""
        out = []
        for r in rows:
            if r.source != MODEL or not r.drafters:
                out.append(r)
                continue
            best, best_rate = None, -1.0
            for i, name in enumerate(r.drafters):
                lag = r.drafter_lags[i] if i < len(r.drafter_lags) else r.drafter_lag
                cand = self._with_history(
                    replace(
                        r,
                        key=self.key_of(r.key, name),
                        drafter=name,
                        acceptance=None,
                        tokens_per_forward=None,
                        drafter_lag=lag,
                    )
                )
                cost = self.cost_of(name, 1)
                p = plan([cand], cost, overlap=self.overlap)
                rate = p.tokens / (p.seconds + cost.catch_up_s(lag)) if p.ks[0] > 0 and p.seconds > 0 else p.rate
                tie = best is not None and abs(rate - best_rate) <= 1e-9 * max(rate, best_rate)
                if best is None or (rate > best_rate and not tie) or (tie and cand.acceptance > best.acceptance):
                    best, best_rate = cand, rate
            out.append(best)
        return out

    def _round_drafter(self, rows: list[RowInfo]) -> str | None:
        """The drafter whose costs price the round: the one most of its model rows use."""
        used = [r.drafter for r in rows if r.source == MODEL and r.drafter is not None]
        order = {n: i for i, n in enumerate(self.drafter_names)}
        return max(dict.fromkeys(used), key=lambda n: (used.count(n), -order.get(n, len(order))), default=None)

    def _best_sources(self, rows: list[RowInfo], cost: RoundCostModel) -> tuple[Plan, list[RowInfo], list[bool]]:
        """The plan of the round, with each model row drafting by the draft model or, where that is
        predicted faster, from what its model-free sources propose (RowInfo.free_k: no drafter
        forward, only the verification to pay). Three candidates: every such row by the model,
        every one free, and free only the rows the model plan leaves at k = 0; the best rate wins.
        A free row's acceptance is tracked apart from its model drafts (free_key)."""
        free = [False] * len(rows)
        best = self._plan(rows, cost)
        if not any(r.free_k > 0 and not r.fixed for r in rows):
            return best, rows, free
        chosen, model_ks = rows, best.ks
        for only_idle in (False, True):
            use = [r.free_k > 0 and not r.fixed and (not only_idle or model_ks[b] == 0) for b, r in enumerate(rows)]
            alt = [self._as_free(r) if u else r for r, u in zip(rows, use)]
            p = self._plan(alt, cost)
            if p.rate > best.rate * (1 + 1e-9):
                best, chosen, free = p, alt, use
        return best, chosen, free

    def _catch_up_paid(self, rows: list[RowInfo], best: Plan, cost: RoundCostModel) -> tuple[Plan, list[RowInfo]]:
        """The plan, unless the drafter's catch-up it needs is not paid back. A model row the
        drafter has not seen lately (drafter_lag: a prompt it never drafted for, tokens decoded
        plainly since) makes it prefill those tokens before it drafts, a cost allocator.plan does
        not see. The plan's time saved a token against the same rows decoding plainly, over the
        tokens the batch's rows may still emit, must beat that prefill; otherwise those rows decode
        plainly (a probe brings the drafter back within probe_budget, its catch-up priced there:
        _budget_gap). Why: on a slow drafter a first drafting round's prefill of the batch's prompts
        can cost more than the whole answer's gain (docs/journal.md, "The event loop woken only for
        a chunk; host work of a plain step"). Rows of unknown remaining: as planned."""
        lagging = [
            b
            for b, r in enumerate(rows)
            if best.ks[b] > 0 and r.source == MODEL and not r.fixed and r.drafter_lag > 0 and r.remaining > 0
        ]
        if not lagging:
            return best, rows
        alt = [replace(r, limit=0) if b in lagging else r for b, r in enumerate(rows)]
        plain = self._plan(alt, cost)
        if not (0 < plain.rate < math.inf and 0 < best.rate < math.inf):
            return best, rows
        saved = (1 / plain.rate - 1 / best.rate) * sum(r.remaining for r in rows)
        if saved > cost.catch_up_s(sum(rows[b].drafter_lag for b in lagging)):
            return best, rows
        return plain, alt

    def _plan(self, rows: list[RowInfo], cost: RoundCostModel) -> Plan:
        """allocator.plan, remembered for the last few inputs: a round whose rows, acceptances
        and cost model are those of a recent one (a batch of rows left at k = 0, whose estimates
        sit at the prior) gets the same plan without computing it again. Exact: the key is every
        input plan reads."""
        key = (
            cost,
            self.overlap,
            tuple((r.limit, r.source, r.acceptance, r.tokens_per_forward, r.fixed) for r in rows),
        )
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = plan(rows, cost, overlap=self.overlap)
            if len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return got

    def _as_free(self, r: RowInfo) -> RowInfo:
        """The row drafting its free offer: priced by its own lookups' record, from the prior of
        the offer's match length (lookup_match.py) where it is known."""
        key = free_key(r.key)
        acceptance = self.tracker.estimate(key, match_prior(r.free_match))
        if not r.free_strong:
            acceptance = min(acceptance, SHORT_MATCH_ACCEPTANCE)
        return RowInfo(key, r.free_k, PLD, round(acceptance, ESTIMATE_DIGITS), 1.0, fixed=False, drafter=r.drafter)

    def cost_for(self, n_rows: int) -> RoundCostModel:
        """The model a round of n_rows is planned from: the frozen one for a row alone, UnderLoad's
        corrected one (once it has rounds to go on) for two rows or more."""
        loaded = self.under_load.model
        return loaded if n_rows > 1 and loaded is not None else self.cost

    def _step_width(self, rows: list[RowInfo], ks: list[int], cost: RoundCostModel) -> list[int]:
        """ks, with every width_every-th round of two rows or more a width step (the module
        docstring): adaptive model rows at the widest k draft one more, or one fewer, in turn."""
        if len(rows) < 2 or self.width_every <= 0 or not cost.batched:
            return ks
        self._batch_rounds += 1
        steppable = [b for b, r in enumerate(rows) if r.source == MODEL and not r.fixed and r.limit > 0]
        width = max((ks[b] for b in steppable), default=0)
        if self._batch_rounds % self.width_every or width == 0:
            return ks
        step = 1 if (self._batch_rounds // self.width_every) % 2 else -1
        for b in steppable:
            if ks[b] == width:
                ks[b] = min(width + step, rows[b].limit)
        self.width_steps += 1
        return ks

    def _probe(self, rows: list[RowInfo], ks: list[int]) -> list[int]:
        """ks, with a probe's k for adaptive rows that have sat at k = 0 for more than probe_every
        rounds: at most max_probes a round, the longest idle first (ties: batch order), so every
        row of a batch gets its turn. In a batch, at the draft model's widest k, and where it drafts
        nothing, 1 draft at most once every probe_every + 1 rounds (the module docstring)."""
        # the model drafter's width: a lookup row's drafts (pld, suffix) cost no drafter forward
        width = max((k for r, k in zip(rows, ks) if r.source == MODEL), default=0)
        idle, batch = self._idle, len(rows) > 1
        for r, k in zip(rows, ks):
            if r.fixed or r.source == NONE or r.limit <= 0 or k > 0:
                idle.pop(r.key, None)
                self._priced.pop(r.key, None)
                if k > 0 and not r.fixed:  # the plan drafts it: probes again at the shortest gap
                    self._gap.pop(r.key, None)
                if k > 0 and r.source == MODEL:  # its drafter drafts: the free drafts' wait starts over
                    idle.pop(free_key(r.key), None)
            else:
                idle[r.key] = idle.get(r.key, 0) + 1
                if r.source == MODEL:  # its free drafts sat unused too (_free_probes)
                    idle[free_key(r.key)] = idle.get(free_key(r.key), 0) + 1
        due = [  # the stored gap first: the budget's price is read only for a row past it
            b
            for b, r in enumerate(rows)
            if idle.get(r.key, 0) > max(self._gap.get(r.key, self.probe_every), self._priced.get(r.key, 0))
            and self._due(r)
        ]
        due.sort(key=lambda b: -idle[rows[b].key])  # stable: batch order among equals
        self._batch_quiet += batch
        if batch and width == 0 and self._batch_quiet <= self.probe_every:
            due = []  # plain decoding for the batch: a probe widens every row, so not every round
        due = due[: self.max_probes]
        self._probing = {rows[b].key for b in due}
        k_probe = max(width, 1) if batch else self.probe_k
        for b in due:
            ks[b], idle[rows[b].key] = min(k_probe, self.probe_k, rows[b].limit), 0
            self._priced.pop(rows[b].key, None)
            if self.frozen:  # else the probes feed the cost check too, which needs them regular
                # the drafter has caught up once it probes: the catch-up is priced anew (_gap_of)
                doubled = min(2 * self._gap.get(rows[b].key, self.probe_every), self.max_probe_every)
                self._gap[rows[b].key] = max(doubled, self._budget_gap(replace(rows[b], drafter_lag=0), ks[b]))
        free_due = self._free_probes(rows, ks, set(due), self.max_probes - len(due), batch)
        if batch and width == 0 and (due or free_due):
            self._batch_quiet = 0
        self.probes += len(due) + len(free_due)
        return ks

    def _free_probes(self, rows: list[RowInfo], ks: list[int], taken: set, room: int, batch: bool) -> list[int]:
        """A model row whose free drafts (prompt lookup: RowInfo.free_k) the plan has left unused
        for longer than their own gap drafts them once (ks and self.free set in place; the rows,
        returned): their acceptance is tracked apart (free_key), and without a round of them it
        would stay at the prior, which on a machine where a wider verification costs much (a
        2-core CPU) prices them out for good, however often the text repeats itself. Such a probe
        costs only the verification's width: no drafter forward, nothing to catch up; with a profile
        measured here its gap doubles after each and keeps them at free_probe_budget of the time
        (_budget_gap; otherwise probe_every, as a model probe's, for the cost check). A row alone
        only: in a batch the probe widens every row's forward, and served at 8 users that cost more
        than it found; probe_k drafts, since one kept draft lifts the estimate too little to ramp
        the row up (both measured: docs/journal.md, "free drafts the prior priced out"). Only an
        offer after a match of lookup's longest n-gram (RowInfo.free_strong): of a shorter match's
        4 drafts 0.77-1.75 were kept on average on our prompts, of a 4-gram's 2.7-3.8 on code and a
        rewrite (docs/journal.md, "Probes on a strong match")."""
        if room <= 0 or batch:
            return []
        due = []
        for b, r in enumerate(rows):
            key = free_key(r.key)
            if b in taken or r.source != MODEL or r.fixed or r.free_k <= 0 or ks[b] > 0 or r.limit <= 0:
                continue
            if not r.free_strong:  # a short match's drafts seldom pay for the probe's width
                continue
            idle = self._idle.get(key, 0)
            if idle <= self._gap.get(key, self.probe_every):  # the stored gap first: priced only past it
                continue
            k = min(self.probe_k, r.free_k, r.limit)
            budget = self._budget_gap(self._as_free(r), k, self.free_probe_budget) if self.frozen else 0
            if idle > budget:
                due.append((b, k, budget))
        due.sort(key=lambda d: -self._idle[free_key(rows[d[0]].key)])  # stable: batch order among equals
        for b, k, budget in due[:room]:
            key = free_key(rows[b].key)
            ks[b], self.free[b], self._idle[key] = k, True, 0
            self._probing.add(key)
            if self.frozen:  # as a model probe's (_probe)
                doubled = min(2 * self._gap.get(key, self.probe_every), self.max_probe_every)
                self._gap[key] = max(doubled, budget)
        return [b for b, _, _ in due[:room]]

    def _due(self, row: RowInfo) -> bool:
        """Whether a row past its stored gap is past its budget's too. The budget's gap only grows
        while the row waits (its drafter lag grows), so it is priced again only once the row's
        idle rounds pass the gap last priced: a round of idle rows prices none of them."""
        gap = self._gap_of(row)
        self._priced[row.key] = gap
        return self._idle[row.key] > gap

    def _gap_of(self, row: RowInfo) -> int:
        """Rounds a row waits at k = 0 before its next probe: probe_every, doubled after each
        probe that left it at k = 0, and, where the profile is frozen, at least the probe's budget
        at the row's drafter lag now (the first probe of a model row has its prompt to prefill)."""
        gap = self._gap.get(row.key, self.probe_every)
        return max(gap, self._budget_gap(row, min(self.probe_k, row.limit))) if self.frozen else gap

    def _budget_gap(self, row: RowInfo, k: int, budget: float | None = None) -> int:
        """Rounds between probes that keep a k-draft probe's extra seconds (over a plain round,
        with the drafter's catch-up of the tokens it missed) at `budget` (probe_budget) of the plain
        rounds' time, as the frozen profile prices them. A catch-up that costs more per token
        than the budget gives a plain round (a drafter forward near a target step) puts the
        next probe out of reach: the row decodes plainly, with its free drafts."""
        cost = self.cost_for(1)
        plain = cost.round_s([0], [row])
        lag = row.drafter_lag if row.source == MODEL else 0  # model-free sources have nothing to catch up
        extra = cost.round_s([k], [row]) - plain + cost.catch_up_s(lag)
        budget = self.probe_budget if budget is None else budget
        return math.ceil(extra / (budget * plain)) if plain > 0 and budget > 0 else 0

    def min_confidence(self, key: str | None = None) -> float:
        """The drafter's stop threshold for the round last chosen (min_confidence_for); 0 for a
        row being probed (a probe measures the drafts, it does not economize on them)."""
        if self.last is None or not self.last.ks or key in self._probing:
            return 0.0
        return min_confidence_for(self.last.rate, self.last.marginal_s)

    # ---- after a round
    def record(self, trace: RoundTrace) -> None:
        """One finished round (RoundTrace), whether or not choose ran for it."""
        t = trace
        model = [kind == MODEL for kind in t.kinds]
        per_row = t.row_forwards if t.row_forwards is not None else [None] * len(t.keys)
        now = [not a for a in t.ahead] if t.ahead is not None else [True] * len(t.keys)
        drafting = [b for b, kind in enumerate(t.kinds) if kind != NONE]  # a plain row has nothing to learn
        self.tracker.observe_round(
            [t.keys[b] for b in drafting],
            [t.drafted[b] for b in drafting],
            [t.kept[b] for b in drafting],
            [per_row[b] if model[b] else None for b in drafting],
        )
        for b in drafting:  # a model row's other sources age too, so that one bad round is not forever
            key = t.keys[b]
            for other in self._sources_of(key):
                if other != key:
                    self.tracker.age(other)
        rows_in_forwards = sum(
            (f if f is not None else min(t.forwards, math.ceil(n / self.tracker.tokens_per_forward(key) - 1e-9)))
            for key, n, f, m, here in zip(t.keys, t.drafted, per_row, model, now)
            if m and n > 0 and here
        )
        if t.others:  # priced by another drafter's costs: what the default's checks would misread
            return
        if len(t.keys) < 2 or t.prefilled:
            self.under_load.skip()
        else:
            self.under_load.observe(self.cost, t.drafted, t.forwards, rows_in_forwards, t.draft_s, t.verify_s)
        if self.frozen:
            return
        better = self.check.observe(
            self.cost, point_of(self.cost, t.drafted), t.verify_s, t.forwards, rows_in_forwards, t.draft_s
        )
        if better is not None:
            log.info("k auto: measured rounds contradict the cost profile's shape; replaced by %s", better.to_dict())
            self.set_profile(better)
            self.frozen = True  # once: from here on plans read this profile only

    def observe_guess(self, key: str, hit: bool) -> None:
        """Draft-ahead: a round kept all its drafts, and the bonus was (hit) or was not the
        drafter's own next token, one more draft of the round (AcceptanceTracker.observe_guess)."""
        self.tracker.observe_guess(key, hit)

    def row_share(self) -> float | None:
        """A row's seconds in a drafter forward over the forward's own, as the cost model prices
        them (the model drafter carries lookup proposals where they pay, drafters.py)."""
        _, per_forward, per_row = self.cost.draft_coefficients
        return float(per_row / per_forward) if per_forward > 0 else None

    def report(self) -> dict:
        """What the service shows of k auto (/v1/fly/stats): the model under load (measured_cost.py)
        and the rows probed since the start."""
        u = self.under_load
        return {
            "under_load": {
                "rounds": u.rounds,
                "refits": u.refits,
                "draft_ratio": u.applied,
                "draft_pairs": u.draft_pairs,
                "draft_slope": u.applied_slope,
                "draft_round_s": u.applied_round_s,
                "width_pairs": u.pairs,
                "width_beta": u.applied_beta,
                "width_steps": self.width_steps,
            },
            "probes": self.probes,
        }

    def _sources_of(self, key: str) -> list[str]:
        """Every key a row keeps acceptance under: its own, its free drafts', each other drafter's."""
        base = base_key(key)
        return [base, free_key(base), *(self.key_of(base, n) for n in self.drafter_names[1:])]

    def release(self, keys):
        for key in keys:
            for k in self._sources_of(key):
                self.tracker.forget(k)
                self._idle.pop(k, None)
                self._gap.pop(k, None)
                self._priced.pop(k, None)
                self._probing.discard(k)
