"""The round loop: draft -> verify in one target forward -> decide for the whole batch -> commit.

Requests join (add) and leave (finish, abort) between rounds. Every mode is the same round:
`ar` drafts nothing (the target forward then decodes one token), `pld` drafts by prompt lookup,
`spd` and `fly` draft with the model drafter; `spd` decides strictly (theta = 1), `fly` with the
gate and window. So a batch may mix modes and knobs freely.
"""
import itertools
import time
from collections import deque

import torch

from .drafters import PLDDrafter
from .params import Params
from .rows import Row
from .stats import Stats
from .verify import decide, effective_window


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: Params):
        self.id, self.params = request_id, params
        self.tokens = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.stats = Stats()
        self.finish_reason: str | None = None
        self.text = ""  # the output so far, cut at a stop string
        self.streamed = 0  # characters of text already handed out by delta()

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def delta(self) -> str:
        """Text not yet handed out; holds back what may still change (a partial UTF-8 character,
        the start of a stop string) until the request finishes."""
        end = len(self.text)
        if not self.finished:
            if self.text.endswith("\ufffd"):
                end -= 1
            for s in self.params.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text[end - n:end] == s[:n]:
                        end = min(end, len(self.text) - n)
                        break
        out = self.text[self.streamed:end]
        self.streamed = max(self.streamed, end)
        return out


class Engine:
    def __init__(self, target, drafter, tokenizer, eos_ids=(), max_batch: int = 8,
                 max_model_len: int = 4096, defaults: Params | None = None):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.pld = PLDDrafter()
        self.eos_ids = set(eos_ids)
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.defaults = defaults or Params()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.last_round: dict = {}

    # ---- requests in and out
    def add(self, prompt, params: Params | dict | None = None, request_id: str | None = None) -> Request:
        """Queue a request; raises ValueError naming the bad field (nothing else is affected)."""
        if isinstance(params, dict):
            params = Params.from_dict({**self.defaults.__dict__, **params})
        params = params or Params(**self.defaults.__dict__)
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        params.validate(len(prompt), self.max_model_len)
        if params.mode in ("spd", "fly") and self.drafter is None:
            raise ValueError(f"mode: {params.mode!r} needs a draft model and this engine has none")
        req = Request(request_id or f"req-{next(self._ids)}", prompt, params)
        self.waiting.append(req)
        return req

    def abort(self, request_id: str):
        for req in list(self.waiting) + self.running:
            if req.id == request_id and not req.finished:
                req.finish_reason = "abort"
        self.waiting = deque(r for r in self.waiting if not r.finished)
        self._retire()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts, params=None) -> list[Request]:
        """Run prompts to completion together; params: one for all, or one per prompt."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add(p, q) for p, q in zip(prompts, per)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ---- one round
    def step(self) -> list[Request]:
        """One round over the running batch; returns the requests it advanced."""
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.popleft())
        batch = list(self.running)
        if not batch:
            return []
        rows = [self._row(r) for r in batch]

        t0 = time.perf_counter()
        drafts, qs = self._draft(batch, rows)
        t1 = time.perf_counter()
        fly = [r.params.mode == "fly" and r.params.theta < 1 for r in batch]
        kinds = [r.params.entropy if f else None for r, f in zip(batch, fly)]
        ok, y, h = self.target.score(rows, drafts, qs, kinds)
        t2 = time.perf_counter()
        n = torch.tensor([len(d) for d in drafts])
        theta = torch.tensor([r.params.theta if f else 1.0 for r, f in zip(batch, fly)])
        window = torch.tensor([effective_window(r.params.window, r.params.window_rule) for r in batch])
        accept_len, loosely = decide(ok, h, n, theta, window)
        t3 = time.perf_counter()

        a_list = accept_len.tolist()
        n_loose = loosely.sum(1).tolist()
        y_list = y.tolist()
        for b, req in enumerate(batch):
            a = a_list[b]
            s = req.stats
            s.rounds += 1
            s.drafted += len(drafts[b])
            s.accepted += a - n_loose[b]
            s.loosely_accepted += n_loose[b]
            s.recovered += a < len(drafts[b])
            s.bonus += a == len(drafts[b]) > 0
            s.draft_s += t1 - t0
            s.verify_s += t2 - t1
            s.decide_s += t3 - t2
            self._commit(req, drafts[b][:a] + [y_list[b][a]])
        self.last_round = dict(batch_size=len(batch), draft_s=t1 - t0, verify_s=t2 - t1, decide_s=t3 - t2,
                               drafted=int(n.sum()), accepted=sum(a_list) - sum(n_loose),
                               loosely_accepted=sum(n_loose), emitted=sum(a_list) + len(batch))
        self._retire()
        return batch

    def _row(self, req: Request) -> Row:
        p = req.params
        # Never draft past what the request may still emit: a round emits at most k + 1.
        room = min(p.max_tokens - len(req.generated), self.max_model_len - len(req.tokens)) - 1
        k = 0 if p.mode == "ar" else max(0, min(p.k, room))
        return Row(req.id, req.tokens, k, p.mla, p.temperature, p.top_p, p.seed)

    def _draft(self, batch, rows):
        drafts, qs = [[] for _ in rows], [None] * len(rows)
        for drafter, modes in ((self.pld, ("pld",)), (self.drafter, ("spd", "fly"))):
            idx = [b for b, r in enumerate(batch) if r.params.mode in modes and rows[b].k]
            if idx:
                d, q = drafter.propose([rows[b] for b in idx])
                for b, db, qb in zip(idx, d, q):
                    drafts[b], qs[b] = db, qb
        return drafts, qs

    def _commit(self, req: Request, new: list[int]):
        p = req.params
        new = new[:p.max_tokens - len(req.generated)]
        for i, t in enumerate(new):
            if t in self.eos_ids:
                new, req.finish_reason = new[:i], "stop"
                break
        req.tokens.extend(new)
        req.stats.emitted += len(new)
        req.text = self.tokenizer.decode(req.generated, skip_special_tokens=True)
        cuts = [i for i in (req.text.find(s) for s in p.stop) if i >= 0]
        if cuts:
            req.text, req.finish_reason = req.text[:min(cuts)], "stop"
        if not req.finished and len(req.generated) >= p.max_tokens:
            req.finish_reason = "length"

    def _retire(self):
        done = [r.id for r in self.running if r.finished]
        if done:
            self.running = [r for r in self.running if not r.finished]
            self.target.release(done)
            if self.drafter is not None:
                self.drafter.release(done)
