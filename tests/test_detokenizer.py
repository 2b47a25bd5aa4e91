"""The incremental detokenizer and stop matching against the whole decode they replace: the same
text, chunk by chunk, on the byte-level tiny tokenizer (every byte its own token, so UTF-8
characters split across tokens and rounds) and on the default pair's real tokenizer."""

import random

import pytest

from fly_serve.engine.detokenizer import IncrementalText, find_stop, held_back
from fly_serve.loading.tiny import tiny_tokenizer


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """ids cut into rounds of 1-16 tokens, as speculative rounds commit them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 16)
        out.append(ids[i : i + n])
        i += n
    return out


def assert_incremental_equals_full(tokenizer, ids: list[int], rng: random.Random) -> None:
    text, parts = IncrementalText(tokenizer), []
    for c in chunks(ids, rng):
        parts.append(text.add(c))
        assert not parts[-1].endswith("\ufffd")  # a split character is held back, never shown half
    parts.append(text.flush())
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)


def test_tiny_byte_tokenizer_with_split_characters_and_specials():
    tok, rng = tiny_tokenizer(), random.Random(0)
    words = ["héllo", " wörld", " 日本語", " 🙂", "\n", " x"]
    for _ in range(50):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text, add_special_tokens=False)
        specials = [256 + rng.randint(0, 2) for _ in range(3)]  # skipped by the decode
        for s in specials:
            ids.insert(rng.randint(0, len(ids)), s)
        assert_incremental_equals_full(tok, ids, rng)


def test_random_bytes_including_invalid_utf8():
    """Bytes that never form a character (a lone continuation byte) show as U+FFFD in the middle,
    as the whole decode shows them."""
    tok, rng = tiny_tokenizer(), random.Random(1)
    for _ in range(50):
        assert_incremental_equals_full(tok, [rng.randint(0, 255) for _ in range(rng.randint(1, 60))], rng)


@pytest.mark.real
def test_real_tokenizer_random_ids_and_code():
    from fly_serve.loading.loading import load_tokenizer
    from fly_serve.loading.weights import DEFAULT_TARGET

    tok, rng = load_tokenizer(DEFAULT_TARGET, progress=lambda *a: None), random.Random(2)
    code = "def f(x):\n    return '日本' + str(x)  # ✓ done\n\tprint(\"🙂\")\n"
    assert_incremental_equals_full(tok, tok.encode(code * 5, add_special_tokens=False), rng)
    for _ in range(30):  # any ids at all, specials included
        assert_incremental_equals_full(tok, [rng.randrange(len(tok)) for _ in range(rng.randint(1, 80))], rng)


def test_stop_search_sees_only_the_new_text_but_finds_the_earliest():
    stops = ["\n\n", "END"]
    assert find_stop("abc\n", stops, 0) is None
    assert find_stop("abc\n\nxEND", stops, 4) == 3  # the stop began in text searched before
    assert find_stop("aEND bEND", stops, 0) == 1
    assert find_stop("abcEN", stops, 3) is None


def test_held_back_is_the_longest_stop_prefix_at_the_end():
    assert held_back("hello EN", ["END"]) == 2
    assert held_back("hello E", ["END", "E!"]) == 1
    assert held_back("hello", ["END"]) == 0
    assert held_back("x\n", ["\n\n", "\nEND"]) == 1
    assert held_back("abab", ["ababc"]) == 4 and held_back("aab", ["aabaab"]) == 3
    assert held_back("xEND", ["END"]) == 0  # a whole stop is find_stop's, not held back


def test_held_back_is_the_definition_on_random_texts():
    """The matcher against the definition (every prefix tried) on small alphabets, where stop
    strings overlap themselves most."""
    rng = random.Random(7)

    def by_definition(text: str, stops: list[str]) -> int:
        return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)

    for _ in range(5000):
        abc = rng.choice(["ab", "abc"])
        text = "".join(rng.choice(abc) for _ in range(rng.randrange(12)))
        stops = ["".join(rng.choice(abc) for _ in range(rng.randint(1, 8))) for _ in range(rng.randrange(4))]
        assert held_back(text, stops) == by_definition(text, stops), (text, stops)


def test_held_back_looks_at_each_character_a_bounded_number_of_times():
    """Linear in a stop string's length (it runs on the engine thread each round): a stop string
    of 10x the length reads about 10x its characters, not 100x (what trying every prefix reads)."""

    class Counting(str):
        compared = 0  # characters of the stop string read, one by one or in slices

        def __getitem__(self, i):
            out = str.__getitem__(self, i)
            Counting.compared += len(out)
            return out

    def comparisons(n: int) -> int:
        Counting.compared = 0
        stop = Counting("a" * (n // 2) + "b" + "a" * (n - n // 2 - 1))
        held_back("a" * (2 * n), [stop])
        return Counting.compared

    assert comparisons(500) < 15 * comparisons(50)


def test_text_costs_linear_decoding_per_request():
    """A request of n tokens decodes O(n) tokens in all (the whole output every round was O(n^2))."""
    tok, rng = tiny_tokenizer(), random.Random(3)
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode("def f(x):\n    return x * 2  # 日本\n" * 40, add_special_tokens=False)
    text = IncrementalText(Counting())
    out = "".join(text.add(c) for c in chunks(ids, rng)) + text.flush()
    assert out == tok.decode(ids)
    assert sum(decoded) <= 6 * len(ids), (sum(decoded), len(ids))
