"""k "auto"'s cost profile measured where the engine runs, through the Scorer / Drafter protocols,
cached per machine, models and versions (tiny models; no speed asserted)."""

import json
import math

import pytest
import torch

from fly_serve.build import build_engine
from fly_serve.config import EngineConfig
from fly_serve.engine.params import Params
from fly_serve.k_auto import cost_calibration as cc
from fly_serve.k_auto.round_cost import CostProfile


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLY_SERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_engine():
    return build_engine("tiny:0", "tiny:1", max_batch=2, calibrate=False, progress=lambda _: None)


def key(k_max=3, **over):
    names = (
        "dtype",
        "drafter_precision",
        "max_batch",
        "drafter_head_cut",
        "draft_ahead",
        "draft_threads",
        "runtime",
        "drafters",
        "reproducible",
    )
    fields = {f: over.pop(f) for f in names if f in over}
    config = EngineConfig("tiny:0", "tiny:1", **({"dtype": "fp32", "max_batch": 2} | fields))
    return cc.calibration_key(config, k_max, **over)  # over: the serving shape


def test_points_cover_one_row_up_to_k_max_then_whole_rows_up_to_max_batch():
    assert cc.verify_points(15, 8) == [(1, 0), (1, 1), (1, 3), (1, 7), (1, 15), (2, 15), (4, 15), (8, 15)]
    assert cc.verify_points(6, 3) == [(1, 0), (1, 1), (1, 3), (1, 6), (2, 6), (3, 6)]
    assert cc.verify_points(3, 1) == [(1, 0), (1, 1), (1, 3)]


def test_shapes_reach_max_batch_and_k_max_and_stay_few():
    assert cc.batch_shapes(15, 8) == ([1, 2, 4, 8], [1, 2, 4, 8, 16])
    assert cc.batch_shapes(6, 3) == ([1, 2, 3], [1, 2, 4, 7])
    for k_max, max_batch in ((15, 8), (31, 64), (7, 256), (3, 1)):
        rows, widths = cc.batch_shapes(k_max, max_batch)
        assert (rows[0], rows[-1], widths[0], widths[-1]) == (1, max_batch, 1, k_max + 1)
        # logarithmic in both: 20 shapes for the served default (max_batch 8, k_max 15)
        assert len(rows) * len(widths) <= (math.log2(max_batch) + 2) * (math.log2(k_max + 1) + 2)
        # the token curve's points are among the timed shapes
        assert {(b, k + 1) for b, k in cc.verify_points(k_max, max_batch)} <= {(b, t) for b in rows for t in widths}


def test_calibration_runs_a_bounded_number_of_calls(tiny_engine):
    scorer, drafter = tiny_engine.scorer, tiny_engine.drafters["model"]
    calls = {"verify": [], "propose": []}

    def recording(part, name):
        method = getattr(part, name)

        def call(rows, *args):
            calls[name].append(len(rows))
            return method(rows, *args)

        setattr(part, name, call)

    recording(scorer, "verify")
    recording(drafter, "propose")
    try:
        profile = cc.measure_profile(scorer, drafter, k_max=3, max_batch=2, reps=2, progress=lambda _: None)
    finally:
        del scorer.verify, drafter.propose
    shapes = len(profile.verify_batch.rows) * len(profile.verify_batch.tokens_per_row)
    assert shapes == 2 * 3
    assert len(calls["verify"]) == 2 + 2 * shapes  # the prefill, a warm-up, then reps a shape
    assert max(calls["verify"]) == 2  # never more rows than max_batch
    assert len(calls["propose"]) == 2 * 2 * (1 + 2)  # per pass and batch size: a warm-up, 1 and DRAFT_K


def test_a_drafter_reading_is_a_short_then_a_long_call(monkeypatch):
    """A warm-up, then a 1-draft and a DRAFT_K-draft call one after the other: the per-forward cost
    is their difference over the forwards between, the rest of a call its overhead."""
    clock = [0.0]
    monkeypatch.setattr(cc.time, "perf_counter", lambda: clock[0])

    class Drafter:
        def __init__(self):
            self.ks = []

        def propose(self, rows):
            self.ks.append(rows[0].k)
            clock[0] += 0.005 + 0.01 * rows[0].k
            return type("Drafts", (), {"forwards": rows[0].k})()

    drafter = Drafter()
    per_forward, extra, average = cc.time_draft(drafter, cc.timing_rows(1, 50, 0))
    assert drafter.ks == [1, 1, cc.DRAFT_K]
    assert per_forward == pytest.approx(0.01) and extra == pytest.approx(0.005)
    assert average == pytest.approx((0.005 + 0.01 * cc.DRAFT_K) / cc.DRAFT_K)


def test_calibration_passes_over_every_shape_before_repeating(tiny_engine, monkeypatch):
    """Pass after pass (all target shapes, then the drafter's rows): each target shape keeps its
    fastest pass, each drafter point the median of its passes, then the lower envelope."""
    order, verify_s, draft_s = (
        [],
        iter([0.3, 0.2, 0.4, 0.5, 0.25, 0.3, 0.45, 0.6, 0.35, 0.25, 0.38, 0.55]),
        iter([0.05, 0.02, 0.04, 0.01, 0.03, 0.03]),  # per pass: 1 row, 2 rows
    )
    monkeypatch.setattr(
        cc, "time_verify", lambda scorer, rows, k, gen: order.append(("v", len(rows), k)) or next(verify_s)
    )
    monkeypatch.setattr(
        cc, "time_draft", lambda drafter, rows: order.append(("d", len(rows))) or (next(draft_s), 0.0, 0.09)
    )
    profile = cc.measure_profile(
        tiny_engine.scorer, tiny_engine.drafters["model"], k_max=1, max_batch=2, reps=3, progress=lambda _: None
    )
    one_pass = [("v", 1, 0), ("v", 1, 1), ("v", 2, 0), ("v", 2, 1), ("d", 1), ("d", 2)]
    assert order == one_pass * 3
    # [rows, tokens] fastest of 3 passes: [[0.25, 0.2], [0.38, 0.5]], then capped by larger shapes
    assert profile.verify_batch.seconds == [[0.2, 0.2], [0.38, 0.5]]
    assert profile.extra["draft_seconds"] == [0.02, 0.02]  # medians 0.04 (1 row), 0.02 (2 rows), enveloped


def test_a_drafter_point_that_noise_swamped_takes_the_plain_average(tiny_engine, monkeypatch):
    """Where the median difference of the short and long calls is <= 0, the long call's plain
    average per forward prices the point, not a free drafter."""
    readings = iter([(-0.01, 0.0, 0.06), (0.08, 0.0, 0.09), (0.0, 0.0, 0.07), (0.09, 0.0, 0.1)])
    monkeypatch.setattr(cc, "time_verify", lambda scorer, rows, k, gen: 0.1)
    monkeypatch.setattr(cc, "time_draft", lambda drafter, rows: next(readings))
    profile = cc.measure_profile(
        tiny_engine.scorer, tiny_engine.drafters["model"], k_max=1, max_batch=2, reps=2, progress=lambda _: None
    )
    # 1 row: the median of -0.01 and 0.0 is <= 0, so the median average, 0.065; 2 rows: 0.085
    assert profile.extra["draft_seconds"] == pytest.approx([0.065, 0.085])
    assert profile.draft_per_forward > 0


def test_lower_envelope_caps_each_shape_by_every_larger_one():
    grid = [[3.0, 2.0, 4.0], [2.5, 5.0, 4.5], [6.0, 1.0, 7.0]]  # [rows, tokens]: noisy
    assert cc.lower_envelope(grid).tolist() == [[1.0, 1.0, 4.0], [1.0, 1.0, 4.5], [1.0, 1.0, 7.0]]
    assert cc.lower_envelope([0.07, 0.04, 0.05, 0.06]).tolist() == [0.04, 0.04, 0.05, 0.06]
    clean = [[1.0, 2.0], [3.0, 4.0]]  # already non-decreasing both ways: unchanged
    assert cc.lower_envelope(clean).tolist() == clean


def test_timed_verifies_feed_only_the_last_token_and_the_drafts(tiny_engine):
    rows = cc.timing_rows(2, tiny_engine.scorer.vocab_size, 0)
    assert [len(r.tokens) for r in rows] == [cc.CONTEXT_TOKENS] * 2 and rows[0].tokens != rows[1].tokens
    runner = tiny_engine.scorer.runner
    fed, feed = [], runner.feed

    def recording_feed(*args, **kw):
        out = feed(*args, **kw)
        fed.append(out[1])
        return out

    runner.feed = recording_feed
    try:
        tiny_engine.scorer.verify(rows, cc.Drafts.empty(2))  # the prefill
        gen = torch.Generator()
        seconds = [cc.time_verify(tiny_engine.scorer, rows, 3, gen) for _ in range(2)]
    finally:
        del runner.feed
        tiny_engine.scorer.release([r.key for r in rows])
    assert all(s > 0 for s in seconds)
    assert fed[-2:] == [[4, 4], [4, 4]]  # the timed calls: last token + 3 drafts per row


def test_measure_profile_times_both_parts_and_releases_its_rows(tiny_engine):
    lines = []
    profile = cc.measure_profile(
        tiny_engine.scorer, tiny_engine.drafters["model"], k_max=3, max_batch=2, reps=1, progress=lines.append
    )
    assert profile.verify_tokens == [1, 2, 4, 8] and all(s > 0 for s in profile.verify_seconds)
    # the batch shapes the engine runs: 1 and 2 rows by 1, 2 and 4 tokens a row
    batch = profile.verify_batch
    assert (batch.rows, batch.tokens_per_row) == ([1, 2], [1, 2, 4])
    assert all(s > 0 for line in batch.seconds for s in line)
    assert profile.verify_seconds == [*batch.seconds[0], batch.seconds[1][-1]]  # the curve: a subset
    assert profile.draft_per_forward + profile.draft_per_row_forward > 0
    assert profile.extra["draft_rows"] == [1, 2]
    assert len(lines) == 2 * 3 + 2 + 1  # a line per target shape, per drafter point, and the total
    # No timing row is left in either KV cache.
    for part in (tiny_engine.scorer, tiny_engine.drafters["model"]):
        assert not [k for k in part.runner.cache.seq_of if k.startswith(cc.KEY_PREFIX)]
    # Without a drafter only the target is timed.
    alone = cc.measure_profile(tiny_engine.scorer, None, k_max=1, max_batch=1, reps=1, progress=lambda _: None)
    assert alone.verify_tokens == [1, 2] and alone.draft_per_forward == 0


def test_calibrate_engine_measures_once_then_reads_the_cache(tiny_engine, cache):
    lines = []
    first = cc.calibrate_engine(tiny_engine, key(), reps=1, progress=lines.append)
    assert tiny_engine.policy.profile is first and any("cached in" in line for line in lines)
    assert tiny_engine.policy.frozen  # measured here: the cost check never replaces it
    assert tiny_engine.policy.cost.batched  # rounds priced by their batch shape
    entry = json.loads(cc.cache_path(key()).read_text())
    assert entry["key"]["machine"]["torch_threads"] == torch.get_num_threads()
    lines.clear()
    again = cc.calibrate_engine(tiny_engine, key(), progress=lines.append)
    assert again.to_dict() == first.to_dict() and lines == [
        f"k auto: cost profile from the cache ({cc.cache_path(key())})"
    ]
    assert cc.load_cached(key(max_batch=4)) is None  # another shape: another entry


def test_the_key_names_machine_models_precision_shape_and_versions():
    k = key(tp_size=2)
    assert set(k) == {
        "machine",
        "target",
        "drafter",
        "dtype",
        "runtime",
        "drafter_precision",
        "drafter_head_cut",
        "max_batch",
        "k_max",
        "versions",
        "extra",
    }
    assert {"cpu", "cpu_flags", "torch_threads", "gpu"} <= set(k["machine"])
    assert {"torch", "transformers", "llama-cpp-python", "fly-serve"} <= set(k["versions"])
    others = (
        key(dtype="bf16"),
        key(max_batch=8),
        key(drafter_precision="fp32"),
        key(drafter_precision="shipped"),
        key(drafter_head_cut=1000),
        key(runtime="llama.cpp"),
    )
    ahead = (key(draft_ahead=True), key(draft_ahead=True, draft_threads=1))  # timed with both sides busy
    hashes = {cc.key_hash(x) for x in (k, key(), key(k_max=4), *others, *ahead)}
    assert len(hashes) == 11
    # a drafter's auto on llama.cpp is its file requantized (loading/gguf_requant.py): named there only
    assert key(runtime="llama.cpp")["drafter_gguf_auto"] == "q4_0" and "drafter_gguf_auto" not in k
    assert cc.key_hash(key()) == cc.key_hash(key())


def test_the_key_names_every_drafter_and_the_kernel_choice():
    """A served app's config keeps AppArgs' default `drafter` beside its `drafters`: the key names
    the drafters (an engine with a Gemma beside the Qwen drafter is not priced as Qwen alone), and
    reproducible's kernels (another cost curve) get their own entry."""
    one = key()
    assert one["drafter"] == "tiny:1"  # one drafter: its model's name, as it always was
    two = key(drafters={"same": "tiny:1", "cross": "tiny-sp:2"})
    assert two["drafter"] == "same=tiny:1,cross=tiny-sp:2"
    tli = key(drafters={"same": "tiny:1", "cross": {"model": "tiny-sp:2", "greedy": "tli"}})
    assert tli["drafter"] == "same=tiny:1,cross=tiny-sp:2:tli"
    assert key(drafters={"same": "tiny:1"})["drafter"] == "tiny:1"
    fixed = key(reproducible=True)
    assert fixed["reproducible"] is True and "reproducible" not in one
    assert len({cc.key_hash(k) for k in (one, two, tli, fixed)}) == 4
    # build_engine's loaded drafters are named as the config would name them
    config = EngineConfig("tiny:0", None, drafters={"same": "tiny:1", "cross": "tiny-sp:2"})
    assert cc.drafters_key(config) == cc.drafters_key(EngineConfig(), {"same": "tiny:1", "cross": "tiny-sp:2"})


def test_a_cached_profile_without_one_of_the_engines_drafters_is_measured_again(cache):
    engine = build_engine(
        "tiny:0", {"a": "tiny:1", "b": "tiny:2"}, max_batch=1, calibrate=False, progress=lambda _: None
    )
    k = key(k_max=1, max_batch=1, drafters={"a": "tiny:1", "b": "tiny:2"})
    alone = cc.measure_profile(engine.scorer, engine.drafters["model"], k_max=1, max_batch=1, reps=1, progress=print)
    assert alone.drafters == {}
    cc.save_cached(k, alone)  # an entry made by an engine that had the default drafter only
    lines = []
    got = cc.calibrate_engine(engine, k, reps=1, progress=lines.append)
    assert set(got.drafters) == {"b"} and any("lacks drafters b" in line for line in lines)
    assert set(cc.load_cached(k).drafters) == {"b"}  # the entry measured again replaces it
    lines.clear()
    assert set(cc.calibrate_engine(engine, k, progress=lines.append).drafters) == {"b"}
    assert lines == [f"k auto: cost profile from the cache ({cc.cache_path(k)})"]


def test_build_engine_calibrates_for_k_auto_and_keeps_an_explicit_profile(cache):
    auto = Params(k="auto", k_max=3)
    lines = []
    engine = build_engine("tiny:0", "tiny:1", max_batch=2, defaults=auto, progress=lines.append)
    assert engine.policy.profile.source == "measured" and any("calibrating" in line for line in lines)
    given = CostProfile([1, 2], [0.1, 0.3], 0.0, 0.05, 0.0, source="mine")
    pinned = build_engine("tiny:0", "tiny:1", max_batch=2, defaults=auto, speculation_profile=given, progress=print)
    assert pinned.policy.profile is given
    fixed = build_engine("tiny:0", "tiny:1", max_batch=2, progress=print)  # k 15: nothing to calibrate
    assert fixed.policy.profile.source == "default shape"
