"""Structured output on tiny random models (fp32): random weights write valid JSON only through
the grammar's mask, so every output that parses and validates shows the mask at work, in every
mode, at T = 0 and T > 0, with k fixed and "auto", batched beside unconstrained rows."""

import functools
import json
import os
import re
import threading
from dataclasses import replace

import jsonschema
import pytest
import torch
from test_row_history import Handle, Replica

from deployments.parts.remote_parts import RemoteDrafter, RemoteScorer
from fly_serve.build import EngineConfig, assemble_engine, build_engine, grammars_for, load_drafter, load_scorer
from fly_serve.contracts import Drafts, Row, RowGrammar
from fly_serve.decision.grammar import DraftMatchers, Grammars, unpack
from fly_serve.engine.params import ParamError, Params
from fly_serve.loading.loading import load_tokenizer
from fly_serve.loading.tiny import tiny_model, tiny_tokenizer

DEVICE = os.environ.get("FLY_TEST_DEVICE", "cpu")  # "cuda" on a GPU host: the masks then apply on the device
TARGET, DRAFTER = tiny_model(seed=0).to(DEVICE), tiny_model(seed=1, num_hidden_layers=1).to(DEVICE)
EOS = 258  # tiny_tokenizer's <|im_end|>
PROMPTS = [[1, 2, 3, 4, 5], [40, 41, 42], [100, 7 + 1, 9, 10, 11, 12]]
# Bounded schemas (enums, short strings, bounded integers and arrays): a random model reaches
# the end of each within max_tokens, so every output is complete.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "n", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
            "who": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/person"}]},
        },
        "required": ["tags", "code", "who"],
        "additionalProperties": False,
        "$defs": {
            "person": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 4}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
    },
]


def rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def engine(**kw):
    return build_engine(TARGET, DRAFTER, tokenizer=tiny_tokenizer(), max_model_len=512, max_batch=64, **kw)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


MODES = ["ar", "spd", "fly", "pld", "suffix", "recycle"]


def test_every_mode_writes_valid_json_batched_with_unconstrained_rows():
    eng = engine()
    # the suffix index and the recycler learn from earlier requests: give them some
    eng.generate([PROMPTS[0]], dict(mode="ar", max_tokens=20, response_format=rf(SCHEMAS[0])))
    cases, params = [], []
    for i, mode in enumerate(MODES):
        for temperature in (0.0, 0.9):
            for k in (3, "auto"):
                schema = SCHEMAS[(i + len(cases)) % 2]
                p = dict(mode=mode, k=k, k_max=4, temperature=temperature, seed=len(cases), max_tokens=120)
                if mode == "fly":
                    p |= dict(theta=0.0, window=1)  # defer every mismatch the grammar allows
                cases.append(schema)
                params.append(p | dict(response_format=rf(schema)))
    free = [dict(mode=m, k=3, max_tokens=12) for m in ("fly", "ar")]  # unconstrained rows alongside
    prompts = [PROMPTS[i % 3] for i in range(len(params) + len(free))]
    reqs = eng.generate(prompts, params + free)
    for req, schema, p in zip(reqs, cases, params):
        assert req.finish_reason == "stop", (p, req.text)
        assert valid(req.text, schema), (p, req.text)
    assert all(r.finish_reason == "length" or r.finish_reason == "stop" for r in reqs[len(params) :])
    assert not all(valid(r.text, SCHEMAS[0]) for r in reqs[len(params) :])  # the mask made the difference


LOSSLESS_BASE = dict(max_tokens=120, response_format=rf(SCHEMAS[1]), k=4)


@functools.cache
def ar_under_a_schema() -> list[list[int]]:
    return [r.generated for r in engine().generate(PROMPTS[:2], LOSSLESS_BASE | dict(mode="ar"))]


@pytest.mark.parametrize(
    "params",
    [dict(mode="spd"), dict(mode="spd", mla=False), dict(mode="fly", theta=1.0), dict(mode="pld"), dict(k="auto")],
)
def test_lossless_modes_equal_ar_under_a_schema(params):
    got = engine().generate(PROMPTS[:2], LOSSLESS_BASE | dict(mode="spd") | params)
    assert [r.generated for r in got] == ar_under_a_schema()
    assert all(valid(r.text, SCHEMAS[1]) for r in got)


def test_regex_and_lark_grammar_of_the_fly_object():
    eng = engine()
    got = eng.generate(
        PROMPTS[:2],
        [
            dict(mode="fly", k=3, regex=r"[a-z]{3}-[0-9]{2,4}", max_tokens=40),
            dict(mode="spd", k=3, temperature=0.7, seed=1, grammar='start: "yes" | "no" | "maybe"', max_tokens=40),
        ],
    )
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", got[0].text), got[0].text
    assert got[1].text in ("yes", "no", "maybe") and got[1].finish_reason == "stop"


def test_json_object_is_an_object():
    eng = engine()
    req = eng.generate([PROMPTS[0]], dict(mode="ar", max_tokens=200, response_format={"type": "json_object"}))[0]
    # a random model writes objects of any depth: only a finished one is whole
    if req.finish_reason == "stop":
        assert isinstance(json.loads(req.text), dict)
    assert req.text.startswith("{")
    text = eng.generate([PROMPTS[0]], dict(mode="ar", max_tokens=5, response_format={"type": "text"}))[0]
    assert text.finish_reason == "length"


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}), "response_format"),
        (dict(response_format=rf({"type": "string", "pattern": "(?<=a)b"})), "response_format"),
        (dict(response_format=rf({"$ref": "#/nowhere"})), "response_format"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(response_format="json"), "response_format"),
        (dict(regex="(a"), "regex"),
        (dict(grammar="start: nope"), "grammar"),
        (dict(regex="a", response_format={"type": "json_object"}), "regex"),
    ],
)
def test_a_refused_grammar_names_its_field(fields, named):
    with pytest.raises(ParamError) as e:
        engine().add(PROMPTS[0], dict(max_tokens=5) | fields)
    assert e.value.field == named


def test_a_grammar_the_library_gives_up_on_midway_fails_its_request_alone():
    """A dead end past the tokens admission walks (12 a's, then a rule no text completes): the
    request ends with an error, never a "stop" the grammar did not reach; the one beside it is
    unaffected."""
    eng = engine()
    eng.eos_ids = {EOS}
    dead_end = dict(mode="ar", max_tokens=30, grammar='start: "aaaaaaaaaaaa" x\nx: x')
    bad, good = eng.generate([PROMPTS[0], PROMPTS[1]], [dead_end, dict(mode="fly", k=4, max_tokens=20)])
    assert bad.finish_reason == "error" and "no text matches it" in bad.error, (bad.finish_reason, bad.error)
    assert good.finish_reason == "length" and len(good.generated) == 20
    # the request's own input ended it: its matcher says so, and which field asked for the grammar
    assert bad.matcher.failed and bad.matcher.field == "grammar"
    assert bad.generated == [ord("a")] * 12  # the literal, then nothing the grammar never reached


@pytest.mark.parametrize("mode", ["spd", "fly"])
def test_a_dead_end_met_by_drafts_alone_fails_nothing(mode):
    """Drafts are tried on a copy of the matcher: a draft that leads into a branch no text
    completes is refused (and kept out of its position's mask), and the request goes on along
    the branch that does complete; the library's error state never reaches the committed one."""
    grammars = Grammars(tiny_tokenizer(), 259, {EOS})
    m = grammars.matcher(Params(grammar='start: "ab" x | "ac"\nx: x "b"'))
    a, b, c = (ord(ch) for ch in "abc")
    legal, masks = m.plan([a, b, b])
    allowed = unpack(masks, 259)
    assert legal == 1 and masks.shape == (2, 9)  # a, then b refused at position 1
    assert allowed[1].nonzero().flatten().tolist() == [c]  # b leads nowhere: only c is left
    assert m.failed is None and m.plan([a])[0] == 1  # the matcher itself is where it was
    eng = engine()
    eng.eos_ids = {EOS}
    [req] = eng.generate([PROMPTS[0]], [dict(mode=mode, k=4, max_tokens=6, grammar='start: "ab" x | "ac"\nx: x "b"')])
    assert req.finish_reason == "stop" and req.text == "ac", (req.finish_reason, req.error, req.text)


def test_the_grammar_checked_off_the_engine_thread_is_the_one_admitted():
    """The ingress's worker compiles and probes a request's grammar (EngineLoop.check_grammar);
    the engine thread admits the request with that matcher (Grammars.handing) and compiles
    nothing: a large schema costs its second once, off the thread that serves every request."""
    from deployments.ingress.engine_loop import EngineLoop

    eng = engine()
    compiled_on = []
    compile_once = eng.grammars._compile

    def counting(params, probe_tokens):
        compiled_on.append(threading.current_thread().name)
        return compile_once(params, probe_tokens)

    eng.grammars._compile = counting
    loop = EngineLoop(eng)
    try:
        params = dict(mode="ar", max_tokens=4, response_format=rf(SCHEMAS[0]))
        matcher = loop.check_grammar(params)  # here: the test's thread stands for the worker
        done = threading.Event()
        req = loop.submit(PROMPTS[0], params, "r1", lambda u: u.finish_reason and done.set(), matcher=matcher).result(
            30
        )
        assert done.wait(60)
        assert req.matcher is matcher and compiled_on == [threading.current_thread().name], compiled_on
        other = loop.submit(PROMPTS[1], params, "r2", lambda u: None).result(30)  # none handed: compiled there
        assert other.matcher is not matcher and compiled_on[-1] == "fly-engine-loop"
    finally:
        loop.stop("test over")
        loop.thread.join(10)


@pytest.mark.parametrize("field", ["regex", "grammar"])
def test_a_lone_surrogate_in_a_grammar_is_refused_naming_its_field(field):
    with pytest.raises(ParamError) as e:
        engine().add(PROMPTS[0], {"max_tokens": 4, field: "a\ud800" if field == "regex" else 'start: "\ud800"'})
    assert e.value.field == field and "Unicode" in e.value.message


def test_a_deep_schema_is_moved_into_defs_and_means_the_same():
    """Past the library's 128 levels, subschemas move to $defs and every $ref into them follows:
    the schema accepts and refuses what the original does."""
    from fly_serve.decision.grammar import LIBRARY_DEPTH, json_depth, shallow_schema

    def nested(levels: int, leaf) -> dict:
        for _ in range(levels):
            leaf = {"type": "object", "properties": {"a": leaf}, "required": ["a"]}
        return leaf

    def value(levels: int, leaf):
        for _ in range(levels):
            leaf = {"a": leaf}
        return leaf

    schema = nested(300, {"type": "integer"})
    schema["properties"]["b"] = {"$ref": "#" + "/properties/a" * 150}  # into what will move
    flat = shallow_schema(schema)
    assert json_depth(schema) > LIBRARY_DEPTH >= json_depth(flat)
    good, bad = value(300, 1) | {"b": value(150, 2)}, value(300, 1) | {"b": value(150, "x")}
    for s in (schema, flat):
        assert jsonschema.Draft202012Validator(s).is_valid(good)
        assert not jsonschema.Draft202012Validator(s).is_valid(bad)
    assert shallow_schema(SCHEMAS[0]) is SCHEMAS[0]  # a schema the library reads as it is stays as it is


def test_plan_cuts_at_the_first_refused_token_and_rolls_back():
    grammars = Grammars(tiny_tokenizer(), 259, {EOS})
    m = grammars.matcher(Params(regex="ab+c"))
    a, b, c, x = (ord(ch) for ch in "abcx")
    legal, masks = m.plan([a, b, x, b])
    assert legal == 2 and masks.shape == (3, 9)  # masks at positions 0, 1 and the refused one
    allowed = unpack(masks, 259)
    assert allowed[0].nonzero().flatten().tolist() == [a]
    assert allowed[2, b] and allowed[2, c] and not allowed[2, x]
    legal, masks = m.plan([a, b, c, EOS])  # after "abc" only EOS; an EOS draft is the last looked at
    assert legal == 4 and masks.shape == (4, 9) and unpack(masks, 259)[3].nonzero().flatten().tolist() == [EOS]
    assert m.plan([b])[0] == 0  # both plans rolled back: still at the start
    m.accept([a, b, c])
    assert m.done


def test_a_sampled_proposal_keeps_its_refused_token_for_the_residual():
    eng = engine()
    req = eng.add(PROMPTS[0], dict(mode="spd", regex="ab+", max_tokens=10, temperature=1.0, seed=0))
    a, b, x = (ord(ch) for ch in "abx")
    q = torch.full((3, 259), 1 / 259)
    drafts = Drafts([[a, x, b]], [q])
    eng._constrain([req], drafts)
    assert drafts.tokens == [[a, x]] and drafts.q[0].shape == (2, 259)  # x stays, to be rejected
    drafts = Drafts([[a, x, b]], [None])
    eng._constrain([req], drafts)
    assert drafts.tokens == [[a]]  # a one-hot proposal is cut before it


def test_the_scorer_reads_the_masked_distribution():
    eng = engine()
    req = eng.add(PROMPTS[0], dict(mode="fly", regex="[0-9]+", max_tokens=10))
    row = Row(req.id, list(req.tokens), k=2, entropy="full")
    one, x = ord("1"), ord("x")
    drafts = Drafts([[one, x]], [None])
    drafts.masks = [req.matcher.plan([one, one])[1]]  # allowed: digits (EOS after the first)
    verdict = eng.scorer.verify([row], drafts)
    assert chr(verdict.y[0, 0]).isdigit() and chr(verdict.y[0, 1]).isdigit()
    assert verdict.support[0].tolist() == [True, False]  # x is outside the grammar: never loosely kept
    # at the mismatch (x), the entropy of 10 digits out of 259 tokens (normalized), not of the vocabulary
    assert 0 < float(verdict.h[0, 1]) < 0.5
    # Token Recycling's top-k is the target's own, unmasked (under the mask most ids are -inf junk)
    free = eng.scorer.verify([replace(row, key="free")], Drafts([[one, x]], [None]))
    assert torch.equal(verdict.topk, free.topk)


def test_sampling_stays_exact_when_a_sampled_draft_leaves_the_grammar():
    """The grammar allows a or b (the target's masked p: 1/2 each); the drafter's q puts 1/2 on
    a and 1/2 on c, which the grammar refuses. With the refused draft kept for its rejection
    (the residual (p - q)+ is all on b), the emitted token is distributed as p; drawing from p
    at a cut draft instead would give a 3/4 of the time."""
    from fly_serve.decision.sampling import speculative_row

    eng = engine()
    req = eng.add(PROMPTS[0], dict(mode="spd", regex="[ab]", temperature=1.0, max_tokens=4))
    a, b, c = (ord(ch) for ch in "abc")
    p = torch.zeros(2, 259)
    p[:, a] = p[:, b] = 0.5  # the target's masked distribution at positions 0 and 1
    q = torch.zeros(1, 259)
    q[0, a] = q[0, c] = 0.5
    g = torch.Generator().manual_seed(0)
    counts = {a: 0, b: 0}
    n = 1500
    for _ in range(n):
        d = a if torch.rand(1, generator=g) < 0.5 else c
        drafts = Drafts([[d]], [q.clone()])
        eng._constrain([req], drafts)
        kept = drafts.tokens[0]
        ok, y = speculative_row(p[: len(kept) + 1], torch.tensor(kept), len(kept), drafts.q[0], g)
        counts[kept[0] if kept and ok[0] else int(y[0])] += 1
    assert abs(counts[a] / n - 0.5) < 0.05, counts  # 4 standard deviations; 0.75 if biased


def test_a_schema_with_draft_ahead_and_the_prefix_cache_gives_the_plain_engines_tokens():
    """The three features of this round together (fp32): constrained and free rows, greedy and
    seeded, with draft-ahead and the prefix cache on, give the plain engine's tokens, and every
    constrained output validates."""
    shared = list(range(30, 70))  # requests sharing a prefix of two full blocks: the cache is used
    prompts = [shared + [1], shared + [2], PROMPTS[1], shared + [3]]
    params = [
        dict(mode="spd", k=4, max_tokens=80, response_format=rf(SCHEMAS[1])),
        dict(mode="fly", k=4, theta=0.0, window=1, max_tokens=80, response_format=rf(SCHEMAS[0])),
        dict(mode="spd", k=3, max_tokens=16),
        dict(mode="spd", k=4, temperature=0.9, seed=5, max_tokens=80, response_format=rf(SCHEMAS[1])),
    ]

    def outputs(**features):
        eng = engine(**features)
        eng.generate([shared + [4]], dict(mode="ar", max_tokens=4))  # fills the prefix cache when on
        return eng.generate(prompts, params)

    plain = outputs()
    both = outputs(draft_ahead=True, prefix_cache=True)
    assert [r.generated for r in both] == [r.generated for r in plain]
    for req, p in zip(both, params):
        if "response_format" in p:
            assert valid(req.text, p["response_format"]["json_schema"]["schema"]), req.text
    assert sum(r.stats.prefix_hit_tokens for r in both) > 0
    # constrained rows bet too: the drafter drafts under their grammar (engine._bets)
    assert all(r.stats.ahead_hits + r.stats.ahead_misses > 0 for r in both)
    assert all(r.stats.ahead_hits > 0 for r, p in zip(both, params) if "response_format" in p and "seed" not in p)
    assert all(r.stats.grammar_cut == 0 for r in both)


def recorded_drafts(eng) -> list[tuple[str, list[int], torch.Tensor | None, int, torch.Tensor | None]]:
    """What the engine's scorer is given from now on: per row and round (key, drafts, masks,
    drafter forwards of the row, q). The real scorer still verifies."""
    seen, verify = [], eng.scorer.verify

    def recording(rows, drafts):
        n = len(rows)
        for b, (r, d) in enumerate(zip(rows, drafts.tokens)):
            masks = drafts.masks[b] if drafts.masks else None
            forwards = drafts.row_forwards[b] if drafts.row_forwards else n
            seen.append((r.key, list(d), masks, forwards, drafts.q[b]))
        return verify(rows, drafts)

    eng.scorer.verify = recording
    return seen


def all_legal(drafts: list[int], masks: torch.Tensor | None) -> bool:
    if masks is None or not drafts:
        return True
    allowed = unpack(masks, 259)
    return masks.shape[0] >= len(drafts) and all(bool(allowed[i, t]) for i, t in enumerate(drafts))


def test_the_model_drafter_drafts_only_what_the_grammar_allows():
    """The drafter drafts under the grammar: every draft a model-drafter row gives the scorer is
    one the grammar allows (the engine cuts none), greedy and sampled, with MLA and without; the
    tokens the grammar forces are drafted several a forward; prompt lookup is still cut."""
    eng = engine()
    seen = recorded_drafts(eng)
    params = [
        dict(mode="spd", k=4),
        dict(mode="fly", k=5, theta=0.0, window=1, mla=False),
        dict(mode="spd", k=4, temperature=0.9, seed=2),
        dict(mode="fly", k="auto", temperature=0.7, seed=3, mla=False),
        dict(mode="pld", k=4),
    ]
    base = [dict(max_tokens=120, response_format=rf(SCHEMAS[i % 2])) for i in range(len(params))]
    reqs = eng.generate([PROMPTS[i % 3] for i in range(len(params))], [b | p for b, p in zip(base, params)])
    for req, b in zip(reqs, base):
        assert valid(req.text, b["response_format"]["json_schema"]["schema"]), req.text
    model = {r.id for r, p in zip(reqs, params) if p["mode"] != "pld"}
    drafted = [(d, m) for key, d, m, _, _ in seen if key in model and d]
    assert len(drafted) > 10 and all(all_legal(d, m) for d, m in drafted)
    # sampled drafts are keyed draws from the masked distribution (no q travels): legal too
    sampled = {r.id for r, p in zip(reqs, params) if p.get("temperature")}
    assert all(q is None for key, _, _, _, q in seen)
    assert sum(1 for key, d, _, _, _ in seen if key in sampled and d) > 5
    assert [r.stats.grammar_cut for r in reqs if r.id in model] == [0, 0, 0, 0]
    assert reqs[-1].stats.grammar_cut > 0  # the counter counts: prompt lookup's proposals are cut
    # without MLA a forward drafts one token, but forced ones (keys, quotes) ride along
    plain = [(len(d), f) for key, d, _, f, _ in seen if key == reqs[1].id and d]
    assert sum(f for _, f in plain) < sum(n for n, _ in plain)


def test_draft_matchers_follow_the_committed_tokens_and_roll_drafts_back():
    grammars = Grammars(tiny_tokenizer(), 259, {EOS})
    text = grammars.matcher(Params(regex="ab+c")).text
    matchers = DraftMatchers(grammars)
    a, b, c, x = (ord(ch) for ch in "abcx")
    prompt = [1, 2]
    row = Row("r", prompt + [a, b], grammar=RowGrammar(text, len(prompt)))
    m = matchers.at(row)
    assert unpack(m.mask(), 259).nonzero().flatten().tolist() == [b, c]
    assert m.push([b, c, EOS]) == 2 and m.forced() == [] and m.done  # EOS is never fed
    m.pop()
    guessed = replace(row, tokens=row.tokens + [b], guessed=1)  # a bet's tail: pushed, not committed
    m = matchers.at(guessed)
    assert m.pushed == 1
    m.pop()
    assert matchers.at(replace(row, tokens=row.tokens + [x], guessed=1)) is None  # a refused tail: no bet
    m = matchers.at(replace(row, tokens=prompt + [a]))  # behind what it fed (never in use): built again
    assert unpack(m.mask(), 259).nonzero().flatten().tolist() == [b]
    m.pop()
    assert matchers.at(replace(row, grammar=None)) is None
    matchers.release(["r"])
    assert not matchers.by_key


@pytest.mark.parametrize("draft_ahead", [False, True])
def test_a_remote_drafter_replica_drafts_under_the_grammar_sent_once(draft_ahead):
    """The drafter as its replica holds it (a RowHistory in front, its own grammar side, no Ray):
    the in-process engine's tokens, no draft cut, the grammar in a row's whole calls only, and
    a replica that restarts mid-generation gets it again. With draft-ahead the constrained rows
    bet (their guessed tails pushed on the replica's matchers, never committed there) and win."""
    config = EngineConfig(target="tiny:0", drafter="tiny:1", max_model_len=512, draft_ahead=draft_ahead)
    params = [
        dict(mode="spd", k=4, max_tokens=100, response_format=rf(SCHEMAS[0])),
        dict(mode="fly", k=4, theta=0.0, window=1, max_tokens=100, response_format=rf(SCHEMAS[1])),
        dict(mode="spd", k=3, max_tokens=12),
    ]
    prompts = PROMPTS
    local = build_engine("tiny:0", "tiny:1", max_model_len=512).generate(prompts, params)

    part = load_drafter(config)
    part.share_grammars(grammars_for(config))
    target, drafter = Replica(load_scorer(config), "verify"), Replica(part, "propose")
    got = []  # (whole, carried a grammar) of every constrained row the replica was sent
    call = drafter.call
    drafter.call = lambda rows, *rest: (
        got.extend((r.start == 0, r.grammar is not None) for r in rows if r.key != reqs[2].id) or call(rows)
    )
    tokenizer = load_tokenizer("tiny:0")
    eng = assemble_engine(
        config, RemoteScorer(Handle(target), len(tokenizer)), RemoteDrafter(Handle(drafter)), tokenizer
    )
    reqs = [eng.add(p, q) for p, q in zip(prompts, params)]
    rounds = 0
    while not all(r.finished for r in reqs):
        eng.step()
        rounds += 1
        if rounds == 3:
            drafter.restart()  # forgets every row's tokens and grammar: they come whole again
    assert [r.generated for r in reqs] == [r.generated for r in local]
    assert [r.stats.grammar_cut for r in reqs] == [0, 0, 0]
    assert got[:2] == [(True, True)] * 2 and rounds > 4
    assert all(whole == grammar for whole, grammar in got)  # with the whole rows only (round 1, after the restart)
    assert 2 < sum(whole for whole, _ in got) < len(got) / 3
    if draft_ahead:
        assert reqs[0].stats.ahead_hits > 0 and reqs[1].stats.ahead_hits > 0
