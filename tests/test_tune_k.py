"""`fly-serve tune-k` on tiny models end to end, and its table math on made-up costs (no speed asserted)."""

import argparse

import pytest
import yaml
from tqdm import tqdm

from fly_cli import tune_k
from fly_cli.main import main
from fly_serve.build import build_engine
from fly_serve.engine.params import Params
from fly_serve.k_auto.cost_calibration import verify_points
from fly_serve.k_auto.round_cost import CostProfile, RoundCostModel

QUICK = ["tune-k", "--target", "tiny:0", "--drafter", "tiny:1", "--quick"]


def table_rows(text: str) -> list[list[str]]:
    """The data rows of the markdown table in tune-k's output, as cells."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows.append(cells)
    return rows


def check_profile(profile: dict) -> RoundCostModel:
    cost = RoundCostModel(CostProfile.from_dict(profile))
    assert RoundCostModel(cost.profile.to_dict()).verify_s(3.0) == pytest.approx(cost.verify_s(3.0))
    assert all(s >= 0 for s in profile["verify"]["seconds"] + list(profile["draft"].values()))
    return cost


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """tune-k writes a cost-profile cache entry: here, not in the user's cache."""
    monkeypatch.setenv("FLY_SERVE_CACHE", str(tmp_path / "cache"))


def test_quick_run_writes_a_profile_the_cost_model_loads(tmp_path, capsys):
    out = tmp_path / "profile.yaml"
    main([*QUICK, "--out", str(out)])
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert [int(r[0]) for r in rows] == list(tune_k.QUICK_BATCH_SIZES)
    assert all(0 <= int(r[1].split()[0]) <= tune_k.QUICK_K_MAX for r in rows)
    snippet = yaml.safe_load(out.read_text())
    assert set(snippet) == {"speculation_profile"}
    profile = snippet["speculation_profile"]
    check_profile(profile)
    # verify knots: the calibration's points for k_max and the largest batch, B * (k + 1)
    points = verify_points(tune_k.QUICK_K_MAX, max(tune_k.QUICK_BATCH_SIZES))
    assert profile["verify"]["tokens"] == [b * (k + 1) for b, k in points]
    assert profile["source"] == "fly-serve tune-k"


def test_run_returns_the_table_and_prints_the_yaml_after_it(capsys):
    parser = argparse.ArgumentParser()
    tune_k.add_args(parser)
    result = tune_k.run(parser.parse_args(QUICK[1:]))
    printed = capsys.readouterr().out
    assert printed.index("| batch |") < printed.index("speculation_profile:")
    snippet = yaml.safe_load(printed[printed.index("# fly-serve tune-k") :])
    assert snippet == {"speculation_profile": result.profile.to_dict()}
    # the same profile is the cache entry an engine with these knobs reads (build_engine's key)
    engine = build_engine(
        "tiny:0",
        "tiny:1",
        max_batch=max(tune_k.QUICK_BATCH_SIZES),
        defaults=Params(k="auto", k_max=tune_k.QUICK_K_MAX),
        progress=lambda _: None,
    )
    assert result.cache_path and engine.policy.profile.to_dict() == result.profile.to_dict()
    assert [r.batch for r in result.rows] == [1, 2]
    for r in result.rows:
        assert len(r.rates) == len(r.spd_rates) == tune_k.QUICK_K_MAX + 1
        assert r.measured is not None and r.measured_k == max(r.best_k, 1)
    assert 0 <= result.fly.acceptance <= 1 and result.fly.rounds > 0


def test_k_grid():
    assert tune_k.k_grid(15) == [0, 1, 3, 7, 15]
    assert tune_k.k_grid(10) == [0, 1, 3, 7, 10]
    assert tune_k.k_grid(3) == [0, 1, 3]
    assert tune_k.k_grid(1) == [0, 1]


def flat_verify_profile(draft_seconds: list[float]) -> dict:
    """A target forward of 1 s at any token count; the drafter's seconds per forward at 1 and 2 rows."""
    return {
        "verify": {"tokens": [1, 1000], "seconds": [1.0, 1.0]},
        "draft": {"rows": [1, 2], "seconds": draft_seconds, "per_round": 0.0},
        "overhead_s": 0.0,
    }


def test_table_math_by_hand():
    # One row, a = 0.5, a forward of the drafter 0.1 s: rate(k) = (2 - 0.5**k) / (1 + 0.1 k):
    # 1, 1.364, 1.458, 1.442, ...: best k = 2.
    cost = RoundCostModel(flat_verify_profile([0.1, 0.1]))
    rates = tune_k.expected_curve(cost, 0.5, 1.0, 1, 5)
    assert rates == pytest.approx([(2 - 0.5**k) / (1 + 0.1 * k) for k in range(6)])
    assert tune_k.best_k(rates) == 2
    # MLA at 2 drafts per forward: k costs ceil(k / 2) forwards, so k = 4 (two forwards,
    # 1.9375 tokens in 1.2 s) beats k = 2 (1.75 in 1.1 s) and k = 3 (1.875 in 1.2 s).
    assert tune_k.best_k(tune_k.expected_curve(cost, 0.5, 2.0, 1, 6)) == 4
    # Two rows, a = 0.6 from the counts, 0.1 s per row per forward (no fixed part):
    # rate(k) = 2 (1 - 0.6**(k+1)) / 0.4 / (1 + 0.2 k) = 2, 2.667, 2.8, 2.72, ...: best k = 2.
    fly = tune_k.Acceptance("fly", 5, kept=6, rejections=4)
    spd = tune_k.Acceptance("spd", 5, kept=0, rejections=3)
    assert fly.acceptance == pytest.approx(0.6) and spd.acceptance == 0.0
    (row,) = tune_k.batch_rows(flat_verify_profile([0.1, 0.2]), fly, spd, [2], 5)
    assert row.rates[:4] == pytest.approx([2.0, 3.2 / 1.2, 3.92 / 1.4, 4.352 / 1.6])
    assert row.best_k == 2 and row.expected_speedup == pytest.approx(3.92 / 1.4 / 2.0)
    assert row.spd_best_k == 0 and row.spd_expected_speedup == 1.0  # nothing kept: drafting never pays


@pytest.fixture(scope="module")
def tiny_engine():
    return build_engine("tiny:0", "tiny:1", max_batch=2, progress=lambda _: None)


def test_measured_speedup_runs_both_modes(tiny_engine):
    prompts = tune_k.acceptance_prompts(tiny_engine.tokenizer, 1)
    measured = tune_k.measure_speedup(tiny_engine, prompts, 2, 1, 6, tqdm(disable=True))
    assert measured.ar_tokens_per_s > 0 and measured.fly_tokens_per_s > 0
    # a batch that ends in its first round: that round's rate (there is no other)
    assert tune_k.decode_tokens_per_s(tiny_engine, prompts, dict(mode="ar", max_tokens=1)) > 0
    assert not tiny_engine.has_work()


def test_tune_k_and_the_cli_do_not_import_each_other():
    """tune_k takes the pair flags from fly_cli/pair.py, not from main.py (which imports tune_k)."""
    import subprocess
    import sys

    code = "import argparse, sys; from fly_cli import tune_k; tune_k.add_args(argparse.ArgumentParser()); "
    code += "print('fly_cli.main' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_draft_ahead_profiles_both_curves_with_overlap(tmp_path, capsys):
    """--draft-ahead: each side's curve timed while the other works, the table costed as
    overlapped rounds; the profile says how it was measured."""
    out = tmp_path / "profile.yaml"
    main([*QUICK, "--draft-ahead", "--out", str(out)])
    rows = table_rows(capsys.readouterr().out)
    assert [int(r[0]) for r in rows] == list(tune_k.QUICK_BATCH_SIZES)
    profile = yaml.safe_load(out.read_text())["speculation_profile"]
    check_profile(profile)
    assert profile["extra"]["overlap"] is True
