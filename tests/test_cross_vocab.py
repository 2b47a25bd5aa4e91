"""Drafters of another model family (fly_serve/drafting/cross_vocab.py) and several drafters per
target, on tiny random models with different tokenizers (fp32 torch): the byte-level target
("tiny:N", Qwen's kind) and SentencePiece-like drafters ("tiny-sp:N", Gemma's kind: `▁`, merged
pieces, byte fallback, other special tokens, characters it lacks).

The drafter that makes the drafts worth verifying is the target's twin in the other vocabulary
(`twin`): the target's weights, each drafter token's embedding row the target's row of the same
text, perturbed; its merged pieces get the mean of their characters' rows, so it sometimes drafts
a whole word where the target continues otherwise, a rejection inside a drafter token."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fly_serve.build import build_engine
from fly_serve.contracts import Row, RowChat
from fly_serve.drafting.cross_vocab import FIXED, RUN, CrossVocabDrafter
from fly_serve.drafting.vocab_map import BYTE, SPECIAL, Vocab, VocabMap, encode_bytes
from fly_serve.engine.params import ParamError
from fly_serve.k_auto.round_cost import PLD, CostProfile
from fly_serve.k_auto.speculation_policy import free_key
from fly_serve.loading.tiny import SP_MISSING, tiny_model, tiny_sp_tokenizer, tiny_sp_vocab_size, tiny_tokenizer

TOK, SP = tiny_tokenizer(), tiny_sp_tokenizer()
SP_PRE = tiny_sp_tokenizer(prepend=True)  # the same pieces, a `▁` put in front of every encoding (Llama 2's kind)


def varied_target():
    """A tiny random target whose greedy text varies (a default tiny model repeats one byte): wider
    initial weights, and the rows of the bytes outside printable ASCII scaled down, so that its
    text is mostly ASCII (shared with the drafter) with some bytes the drafter lacks."""
    model = tiny_model(seed=0, initializer_range=0.2)
    with torch.no_grad():
        rows = model.model.embed_tokens.weight  # tied: the head too
        ascii_ = torch.zeros(rows.shape[0], dtype=torch.bool)
        ascii_[32:127] = True
        rows[~ascii_] *= 0.7
    return model


TARGET = varied_target()
SAME = tiny_model(seed=1, num_hidden_layers=1)  # a drafter of the target's own tokenizer
VMAP = VocabMap.build(Vocab.of(TOK), Vocab.of(SP))
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "the Queue is not None in this class",
    "import data from value ~ result | len",
    "naïve café: the résumé in range",
]


def twin(noise: float, seed: int = 3):
    """The target in the SentencePiece-like vocabulary (module docstring)."""
    model = tiny_model(seed, vocab_size=tiny_sp_vocab_size(), eos_token_id=1, pad_token_id=0, bos_token_id=2)
    state = {k: v for k, v in TARGET.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    model.load_state_dict(state, strict=False)
    rows, own = model.model.embed_tokens.weight, TARGET.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for j in range(len(VMAP.drafter)):
            piece, kind = VMAP.drafter.piece(j), VMAP.drafter.kinds[j]
            if kind == SPECIAL or not piece:
                continue
            byte_rows = own[list(piece)]  # the target's id of a byte is the byte (tiny_tokenizer)
            row = byte_rows[0] if len(piece) == 1 else byte_rows.mean(0) * 1.2
            rows[j] = row + noise * row.norm() / row.numel() ** 0.5 * torch.randn(row.shape, generator=gen)
    return model


TWIN = twin(noise=0.05)


def engine(drafter=(TWIN, SP), **kw):
    eng = build_engine(TARGET, drafter, tokenizer=TOK, max_model_len=256, progress=lambda _: None, **kw)
    eng.eos_ids = set()  # random models: run every request to max_tokens
    return eng


def prompts():
    return [TOK.encode(t) for t in TEXTS]


AR = [r.generated for r in engine(None).generate(prompts(), dict(mode="ar", max_tokens=24))]


# ---- the vocabulary map
def test_the_map_shares_whole_text_tokens_only():
    tv, dv = VMAP.target, VMAP.drafter
    shared_text = {tv.piece(t) for t in VMAP.shared_target.tolist() if t != tv.eos}
    assert shared_text == {bytes([c]) for c in range(128)} - {c.encode() for c in SP_MISSING} - {
        bytes([c]) for c in range(128) if not (32 <= c < 127 or c in (9, 10))
    }
    # a byte-level piece of part of a character is never shared; nor a byte-fallback piece
    assert all(VMAP.to_drafter[b] < 0 for b in range(128, 256))
    assert all(VMAP.to_target[j] < 0 for j in range(len(dv)) if dv.kinds[j] == BYTE)
    # the space is Ġ on one side and ▁ on the other; "the" is one drafter token and three target ones
    assert dv.piece(int(VMAP.to_drafter[ord(" ")])) == b" "
    assert SP.convert_ids_to_tokens(SP.encode(" the", add_special_tokens=False)) == ["▁the"]
    assert VMAP.to_drafter[tv.eos] == dv.eos and VMAP.to_target[dv.eos] == tv.eos  # the ends are paired
    both = torch.stack([VMAP.shared_target, VMAP.shared_drafter])
    assert (torch.tensor(VMAP.to_target)[both[1]] == both[0]).all()  # one to one, both ways


def test_the_map_is_cached_per_pair(tmp_path):
    first = VocabMap.between(TOK, SP, tmp_path)
    (path,) = (tmp_path / "vocab-maps").glob("*.npz")
    again = VocabMap.load(path)
    assert (again.to_drafter == first.to_drafter).all() and again.drafter.data == first.drafter.data
    assert VocabMap.between(TOK, SP, tmp_path).n_shared == first.n_shared == VMAP.n_shared
    VocabMap.between(TOK, TOK, tmp_path)  # another pair, another entry
    assert len(list((tmp_path / "vocab-maps").glob("*.npz"))) == 2


def test_bytes_reencode_exactly_on_both_sides():
    data = "naïve Queue ~ x".encode() + b"\xc3"  # a character cut off at the end
    for tok, vocab in ((TOK, VMAP.target), (SP, VMAP.drafter), (SP_PRE, VMAP.drafter)):
        assert vocab.text_of(encode_bytes(tok, vocab, data)) == data
        for text in ("abc", " the", "\nthe", "the"):  # where the prepended space would go
            assert vocab.text_of(encode_bytes(tok, vocab, text.encode())) == text.encode()
    assert VMAP.drafter.text_of(SP_PRE.encode("abc", add_special_tokens=False)) == b" abc"  # what it does alone


# ---- the drafter's stream follows the target's tokens
def cross(tokenizer=SP) -> CrossVocabDrafter:
    eng = engine((TWIN, tokenizer))
    return eng.drafters["model"]


@pytest.mark.parametrize("tokenizer", [SP, SP_PRE], ids=["sentencepiece", "prepends-a-space"])
@settings(max_examples=40, deadline=None)
@given(
    text=st.text(alphabet="ab Q~\n\tthe réturn", max_size=30), cuts=st.lists(st.integers(0, 40), min_size=1, max_size=4)
)
def test_the_stream_is_the_target_text_whatever_was_cut_back(tokenizer, text, cuts):
    """Followed call after call (the target's tokens cut back at random, as rejected drafts are,
    then extended), the drafter's stream is always the target's text, and the same stream as a
    fresh drafter makes of the same tokens; also with a drafter tokenizer that prepends a space to
    every encoding (each run of text re-encoded would gain one)."""
    drafter, fresh = cross(tokenizer), cross(tokenizer)
    tokens = TOK.encode(text) or [ord("a")]
    for cut in cuts:
        seen = tokens[: min(cut, len(tokens))] + [ord("x")] * (cut % 3)
        drafter.follow(Row("r", seen))
    got = drafter.follow(Row("r", tokens))
    assert got[0] == SP.bos_token_id  # its own BOS (the target adds none)
    assert VMAP.drafter.text_of(got[1:]) == VMAP.target.text_of(tokens)
    assert got == fresh.follow(Row("r", tokens))


def test_streams_are_compact_and_bounded_by_their_tokens():
    """A run of shared tokens is one segment (a rejection inside it cuts at the token), and the
    streams of rows never released (a row moved to another replica group) are dropped, least
    recently followed first, once all streams together hold more than max_stream_tokens."""
    drafter = cross()
    shared = TOK.encode("def add(a, b):\n    return a + b\n" * 4)  # all of it shared (ASCII the drafter has)
    got = drafter.follow(Row("r", shared))
    s = drafter.streams["r"]
    assert list(s.kinds) == [FIXED, RUN] and len(s) == len(shared) + len(got)
    assert drafter.follow(Row("r", shared[:50] + [ord("Q")])) == got[:51] + encode_bytes(SP, VMAP.drafter, b"Q")
    assert drafter.follow(Row("r", shared)) == got  # cut inside the run, extended again
    assert list(s.kinds) == [FIXED, RUN]

    bound = 10 * (2 * len(shared) + 1)
    small = CrossVocabDrafter(drafter.inner, VMAP, TOK, SP, max_stream_tokens=bound)
    for i in range(40):
        small.follow(Row(f"r{i}", shared))
        assert small.stream_tokens == sum(len(x) for x in small.streams.values()) <= bound
    assert list(small.streams) == [f"r{i}" for i in range(30, 40)]  # the least recent went first
    small.follow(Row("r35", shared))  # followed again: the most recent now
    small.follow(Row("new", shared))
    assert "r30" not in small.streams and "r35" in small.streams
    small.release(["r35", "new", "never-followed"])
    assert small.stream_tokens == sum(len(x) for x in small.streams.values())


def test_a_chat_prompt_opens_with_the_drafters_own_template():
    messages = [{"role": "user", "content": "the Queue"}]
    prompt = TOK.encode(TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    row = Row("c", prompt + TOK.encode("the"), chat=RowChat((("user", "the Queue"),), len(prompt)))
    got = cross().follow(row)
    assert SP.decode(got) == "<bos><start_of_turn>user\nthe Queue<end_of_turn>\n<start_of_turn>model\nthe"


# ---- exactness
def test_greedy_spd_through_a_drafter_of_another_family_is_the_targets_text():
    for method in ("tli", "string"):
        for params in (dict(mode="spd", k=4), dict(mode="fly", theta=1.0, k=6), dict(mode="spd", k="auto")):
            reqs = engine().generate(prompts(), dict(max_tokens=24, cross_vocab=method, **params))
            assert [r.generated for r in reqs] == AR, (method, params)
    # the twin drafts well, and not perfectly: both kept and rejected drafts were verified
    reqs = engine().generate(prompts(), dict(mode="spd", k=4, max_tokens=24, cross_vocab="string"))
    assert sum(r.stats.accepted for r in reqs) > 0 and sum(r.stats.recovered for r in reqs) > 0
    # a drafter tokenizer that prepends a space to every encoding drafts as well: it sees the same stream
    same = engine((TWIN, SP_PRE)).generate(prompts(), dict(mode="spd", k=4, max_tokens=24, cross_vocab="string"))
    assert [r.generated for r in same] == AR
    assert [r.stats.accepted for r in same] == [r.stats.accepted for r in reqs]


def test_a_rejection_inside_a_drafter_token_and_a_token_it_lacks():
    """A string-level draft of a merged piece ("▁return") is several target tokens; the target
    rejecting the second of them rejects inside the drafter's token, and the drafter's stream and
    KV cache go back to the target's text. "Q" and "é" the drafter lacks (byte fallback): TLI can
    never draft them, string-level drafts them by its byte tokens."""
    drafter = cross()
    tokens = TOK.encode("x = ")
    drafts = drafter.retokenize(tokens, SP.encode(" return Q\u00e9", add_special_tokens=False))
    assert TOK.decode(drafts) == " return Q\u00e9" and len(drafts) == len(b" return Q") + 2
    drafter.follow(Row("m", tokens + drafts[:2]))  # as if " r" had been drafted and kept ...
    got = drafter.follow(Row("m", tokens + drafts[:1] + TOK.encode("y")))  # ... and "r" rejected for "y"
    assert VMAP.drafter.text_of(got[1:]) == b"x =  y"
    assert VMAP.to_drafter[ord("Q")] < 0 and all(VMAP.to_drafter[b] < 0 for b in "\u00e9".encode())
    # end to end: prompts whose continuations hold tokens the drafter lacks stay the target's text
    for method in ("tli", "string"):
        reqs = engine().generate(prompts(), dict(mode="spd", k=5, max_tokens=24, cross_vocab=method))
        assert [r.generated for r in reqs] == AR


def test_a_tli_draw_is_the_draw_the_target_makes_with_the_same_distribution():
    """Coupling: a distribution laid out over the drafter's vocabulary, drawn with the token keys
    of the target ids its columns stand for (sampling.token_keys), gives the token the target's
    keyed draw gives from the same distribution over its own ids, position by position; with the
    drafter's own keys it agrees only by chance."""
    from fly_serve.decision.sampling import keyed_draw, token_keys

    torch.manual_seed(0)
    vt, vd, n = 50, 80, 400
    to_target = torch.full((vd,), -1, dtype=torch.long)
    shared = torch.randperm(vd)[:40]
    to_target[shared] = torch.randperm(vt)[:40]
    pd = torch.rand(n, vd) * (to_target >= 0)  # [n, Vd]: zero off the shared tokens (TLI's mask)
    pt = torch.zeros(n, vt)
    pt[:, to_target[shared]] = pd[:, shared]  # the same distribution over the target's ids
    keys, positions = torch.full((n,), 1234, dtype=torch.long), torch.arange(n) + 7
    on_target = keyed_draw(pt, keys, positions)
    coupled = to_target[keyed_draw(pd, keys, positions, token_keys(to_target.clamp(min=0)))]
    assert torch.equal(coupled, on_target)
    uncoupled = to_target[keyed_draw(pd, keys, positions)]
    assert (uncoupled == on_target).float().mean() < 0.5


def test_sampling_through_tli_keeps_the_targets_distribution():
    """At T > 0 (TLI: drafts among the shared tokens, drawn with the target's numbers), the first
    two tokens emitted are distributed as the target's own: a chi-square test of their
    frequencies over many seeds against the target's exact distribution. A negative control (the
    drafts shipped with a q that is not their distribution, a thousandth at the draft, so that the
    p/q test accepts nearly every draft and the text follows the drafter) must fail the same test."""
    temperature, n, prompt = 0.7, 1200, TOK.encode("def f(x):")
    with torch.no_grad():
        p1 = torch.softmax(TARGET(torch.tensor([prompt])).logits[0, -1] / temperature, -1)  # [V]
        seqs = torch.tensor([prompt + [t] for t in range(len(p1))])
        p2 = torch.softmax(TARGET(seqs).logits[:, -1] / temperature, -1)  # [V, V]: the second given the first
    joint_second = p1 @ p2  # the second token's marginal

    def draws(eng) -> tuple[torch.Tensor, torch.Tensor]:
        firsts, seconds = torch.zeros(len(p1)), torch.zeros(len(p1))
        params = [dict(mode="spd", k=3, max_tokens=2, temperature=temperature, seed=s) for s in range(n)]
        for r in eng.generate([prompt] * n, params):
            firsts[r.generated[0]] += 1
            seconds[r.generated[1]] += 1
        return firsts, seconds

    eng = engine(max_batch=64)
    firsts, seconds = draws(eng)
    assert chi_square_p(firsts, p1) > 1e-3 and chi_square_p(seconds, joint_second) > 1e-3
    assert eng.drafters["model"].drafted["tli"] > 0 and eng.drafters["model"].drafted["string"] == 0

    class Unnormalised:  # a q that is not the drafts' distribution: the p/q test is not lossless then
        def __init__(self, inner):
            self.inner, self.runner, self.kv_capacity_tokens = inner, inner.runner, inner.kv_capacity_tokens

        def propose(self, rows):
            got = self.inner.propose(rows)
            for b, drafted in enumerate(got.tokens):
                if drafted:
                    q = torch.zeros(len(drafted), len(p1))
                    q[torch.arange(len(drafted)), torch.tensor(drafted)] = 1e-3
                    got.q[b] = q
            return got

        def release(self, keys):
            self.inner.release(keys)

    bad = engine(max_batch=64)
    bad.drafters["model"] = Unnormalised(bad.drafters["model"])
    firsts, _ = draws(bad)
    assert chi_square_p(firsts, p1) < 1e-3


def chi_square_p(counts: torch.Tensor, p: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of counts against p, bins of expected < 5 pooled."""
    expected = p.double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


# ---- several drafters
def test_a_batch_mixing_drafters_and_model_free_rows_is_every_rows_target_text():
    eng = engine({"same": SAME, "cross": (TWIN, SP)})
    params = [
        dict(mode="spd", k=4, drafter="same"),
        dict(mode="spd", k=4, drafter="cross", cross_vocab="tli"),
        dict(mode="fly", theta=1.0, k=5, drafter="cross", cross_vocab="string"),
        dict(mode="pld"),
    ]
    reqs = eng.generate(prompts(), [dict(max_tokens=24, **p) for p in params])
    assert [r.generated for r in reqs] == AR
    assert set(reqs[0].stats.by_drafter) == {"same"} and set(reqs[1].stats.by_drafter) == {"cross"}
    auto = eng.generate(prompts(), dict(mode="spd", k="auto", max_tokens=24))  # k auto picks per row
    assert [r.generated for r in auto] == AR


def test_k_auto_picks_the_drafter_that_pays_per_row():
    """Of a drafter that always agrees with the target (the target itself) and one that never
    does, k auto's rows end up drafting with the one that pays, after trying both."""
    never = tiny_model(seed=9, num_hidden_layers=1)
    with torch.no_grad():  # its favourite token everywhere: a byte the target never continues with
        never.lm_head.weight.zero_()
        never.lm_head.weight[7, 0] = 1e4
        never.model.norm.weight.fill_(1.0)
    eng = engine({"never": never, "target": TARGET})
    cheap_and_frozen(eng)  # the tiny target as drafter costs a target step here
    reqs = eng.generate(prompts()[:2], dict(mode="spd", k="auto", max_tokens=60))
    ar = engine(None).generate(prompts()[:2], dict(mode="ar", max_tokens=60))
    assert [r.generated for r in reqs] == [r.generated for r in ar]
    for r in reqs:
        by = r.stats.by_drafter
        assert by["target"]["drafted"] > 3 * by.get("never", {"drafted": 0})["drafted"]
        assert by["target"]["kept"] == by["target"]["drafted"]


class Recording:
    """A model drafter as it is, with the rows of each call it got; failing: every call raises
    (its replica gone)."""

    def __init__(self, inner, failing: bool = False):
        self.inner, self.runner, self.kv_capacity_tokens = inner, inner.runner, inner.kv_capacity_tokens
        self.failing, self.proposed, self.released = failing, [], []

    def propose(self, rows):
        self.proposed.append([r.key for r in rows])
        if self.failing:
            raise ConnectionError("the drafter's replica is gone")
        return self.inner.propose(rows)

    def release(self, keys):
        self.released += keys
        self.inner.release(keys)


def cheap_and_frozen(eng) -> None:
    """Every drafter priced alike and cheap (a drafter forward a tenth of a target step), frozen:
    k auto drafts, and its choice among drafters is the rows' acceptance and catch-up alone."""
    cheap = dict(CostProfile.coerce(None).to_dict(), draft={"per_forward": 0.1, "per_row_forward": 0.0})
    eng.policy.set_profile(CostProfile.from_dict(cheap), measured_here=True)


def test_a_finished_request_is_released_only_by_the_drafters_it_drafted_with():
    """A drafter pool a request never reached gets no release of it (a pool whose replica is gone
    would cost every retire a call)."""
    eng = engine({"same": SAME, "cross": (TWIN, SP)})
    same, cross = Recording(eng.drafters["model"]), Recording(eng.others["cross"])
    eng.drafters["model"], eng.others["cross"] = same, cross
    params = [dict(mode="spd", k=4, drafter="same"), dict(mode="spd", k=4, drafter="cross"), dict(mode="ar")]
    reqs = eng.generate(prompts()[:3], [dict(max_tokens=8, **p) for p in params])
    assert same.released == [reqs[0].id] and cross.released == [reqs[1].id]


def test_a_failing_drafter_is_left_out_of_k_autos_choice_and_its_rows_count_as_lookup():
    """k auto's first choice (the drafters tie: the first listed) fails: its rows get prompt-lookup
    drafts, counted as prompt lookup's (not the drafter's acceptance, not its drafts in the stats),
    and the drafter is left out of the choice until its backoff is over; it is tried again then,
    and a second failure leaves it out twice as long."""
    eng = engine({"cross": (TWIN, SP), "same": SAME})
    broken = Recording(eng.drafters["model"], failing=True)
    eng.drafters["model"] = broken
    now = [0.0]
    eng.drafter_backoff.clock = lambda: now[0]
    cheap_and_frozen(eng)
    traces, record = [], eng.policy.record
    eng.policy.record = lambda t: traces.append((len(broken.proposed), t)) or record(t)
    reqs = eng.generate(prompts()[:2], dict(mode="spd", k="auto", max_tokens=24))
    assert [r.generated for r in reqs] == AR[:2]
    assert len(broken.proposed) == 1  # tried once
    failed = next(t for calls, t in traces if calls == 1)  # what k auto learnt of the failed round
    rows = [i for i, r in enumerate(reqs) if r.id in broken.proposed[0]]
    assert [(failed.kinds[i], failed.keys[i]) for i in rows] == [(PLD, free_key(reqs[i].id)) for i in rows]
    assert all("cross" not in r.stats.by_drafter for r in reqs)
    assert sum(r.stats.by_drafter.get("pld", {}).get("drafted", 0) for r in reqs) > 0  # the fallback's
    assert sum(r.stats.by_drafter.get("same", {}).get("drafted", 0) for r in reqs) > 0
    assert eng.drafter_backoff.period("cross") == eng.drafter_backoff.first_s
    now[0] += 1.5 * eng.drafter_backoff.first_s  # its backoff is over
    eng.generate(prompts()[2:3], dict(mode="spd", k="auto", max_tokens=24))
    assert len(broken.proposed) == 2 and eng.drafter_backoff.period("cross") == 2 * eng.drafter_backoff.first_s


def test_k_auto_is_told_each_candidate_drafters_own_catch_up():
    """RowInfo.drafter_lags: per drafter a row may use, the tokens it has not seen of the row."""
    eng = engine({"same": SAME, "cross": (TWIN, SP)})
    cheap_and_frozen(eng)
    seen, choose = [], eng.policy.choose
    eng.policy.choose = lambda rows: seen.append(rows[0]) or choose(rows)
    req = eng.add(prompts()[0], dict(mode="spd", k="auto", max_tokens=24))
    while not req.finished:
        eng.step()
    assert seen[0].drafters == ("same", "cross") and seen[0].drafter_lags == (req.n_prompt, req.n_prompt)
    assert all(r.drafter_lag == r.drafter_lags[r.drafters.index(r.drafter or "same")] for r in seen)
    assert any(len(set(r.drafter_lags)) == 2 and min(r.drafter_lags) < req.n_prompt for r in seen[1:])


def test_an_unknown_drafter_is_refused_naming_the_field():
    eng = engine({"same": SAME, "cross": (TWIN, SP)})
    try:
        eng.add(prompts()[0], dict(drafter="nope", max_tokens=8))
    except ParamError as e:
        assert e.field == "drafter" and "same, cross" in e.message
    else:
        raise AssertionError("an unknown drafter was admitted")
    with pytest.raises(ParamError) as e:  # a long name is quoted as a short prefix
        eng.add(prompts()[0], dict(drafter="x" * 100_000, max_tokens=8))
    assert e.value.field == "drafter" and len(str(e.value)) < 200 and "100002 characters" in str(e.value)


def test_several_drafters_by_name_and_the_llama_cpp_runtime():
    """build_engine loads several drafters by name, one of another tokenizer (the tiny GGUF files
    on llama.cpp's kernels); greedy spd stays the llama.cpp target's own greedy text."""
    kw = dict(max_model_len=256, progress=lambda _: None, runtime="llama.cpp", calibrate=False)
    plain = build_engine("tiny:0", None, **kw)
    plain.eos_ids = set()
    want = [r.generated for r in plain.generate(prompts(), dict(mode="ar", max_tokens=16))]
    eng = build_engine("tiny:0", {"same": "tiny:1", "cross": "tiny-sp:2"}, **kw)
    eng.eos_ids = set()
    assert isinstance(eng.others["cross"], CrossVocabDrafter)
    for method in ("tli", "string"):
        reqs = eng.generate(prompts(), dict(mode="spd", k=4, max_tokens=16, drafter="cross", cross_vocab=method))
        assert [r.generated for r in reqs] == want
