"""The grammar library choice (fly_serve/grammar.py), measured: llguidance against xgrammar on
the default pair's tokenizer (tokenizer only, no weights): time to compile each schema, time of
one token mask, and whether a valid instance of the schema is accepted token by token.

    python -m fly_bench.oneoff.grammar_libs llguidance
    python -m fly_bench.oneoff.grammar_libs xgrammar     # needs `pip install -e .[xgrammar]`

The schemas cover nested objects, arrays, enums, anyOf / oneOf, pattern and a recursive $ref.
"""

import argparse
import importlib
import json
import statistics
import time

from fly_serve.loading import load_tokenizer
from fly_serve.weights import DEFAULT_TARGET

SCHEMAS = {
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "age": {"type": "integer", "minimum": 0, "maximum": 150},
                        "address": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["name", "age", "address"],
                }
            },
            "required": ["user"],
        },
        {"user": {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "W1"}}},
    ),
    "array": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                        },
                        "required": ["id", "tags"],
                    },
                }
            },
            "required": ["items"],
        },
        {"items": [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}, {"id": 3, "tags": ["xyz"]}]},
    ),
    "enum": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                "ok": {"type": "boolean"},
            },
            "required": ["color", "size", "ok"],
        },
        {"color": "green", "size": "XL", "ok": True},
    ),
    "anyOf": (
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}, {"type": "null"}]},
                "shape": {
                    "oneOf": [
                        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}},
                        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}}},
                    ]
                },
            },
            "required": ["value", "shape"],
        },
        {"value": "hello", "shape": {"kind": "square", "side": 2.5}},
    ),
    "pattern": (
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            },
            "required": ["date", "email"],
        },
        {"date": "2024-01-31", "email": "ada@example.com"},
    ),
    "ref": (
        {
            "type": "object",
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["name"],
                }
            },
            "properties": {"root": {"$ref": "#/$defs/node"}},
            "required": ["root"],
        },
        {"root": {"name": "a", "children": [{"name": "b", "children": []}, {"name": "c"}]}},
    ),
}
SEPARATORS = (", ", ": ")


class LLGuidance:
    def __init__(self, tok):
        self.lib = importlib.import_module("llguidance")
        self.tokenizer = importlib.import_module("llguidance.hf").from_tokenizer(tok)

    def compile(self, schema):
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        m = self.lib.LLMatcher(self.tokenizer, self.lib.LLMatcher.grammar_from_json_schema(schema, options))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def allowed(self, m, token: int) -> bool:
        mask = m.compute_bitmask()
        return bool((mask[token // 8] >> (token % 8)) & 1)

    def accept(self, m, token: int) -> None:
        m.consume_token(token)

    def finished(self, m) -> bool:
        return m.is_accepting()


class XGrammar:
    def __init__(self, tok):
        self.lib = importlib.import_module("xgrammar")
        info = self.lib.TokenizerInfo.from_huggingface(tok)
        self.compiler = self.lib.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = self.lib.allocate_token_bitmask(1, info.vocab_size)
        self.stop = info.stop_token_ids[0]

    def compile(self, schema):
        g = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)
        return self.lib.GrammarMatcher(g)

    def allowed(self, m, token: int) -> bool:
        m.fill_next_token_bitmask(self.bitmask)
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, m, token: int) -> None:
        m.accept_token(token)

    def finished(self, m) -> bool:
        return m.accept_token(self.stop)  # EOS is accepted only where the schema is complete


def measure(lib, tok, schema, instance, reps: int) -> dict:
    ids = tok.encode(json.dumps(instance, separators=SEPARATORS), add_special_tokens=False)
    compile_s, mask_s, ok = [], [], True
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            m = lib.compile(schema)
        except Exception as e:  # refused: coverage
            return dict(refused=str(e)[:100])
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            ok &= lib.allowed(m, t)
            mask_s.append(time.perf_counter() - t0)
            lib.accept(m, t)
        ok &= lib.finished(m)
    return dict(
        compile_ms=round(statistics.median(compile_s) * 1e3, 2),
        mask_us=round(statistics.median(mask_s) * 1e6, 1),
        mask_mean_us=round(statistics.mean(mask_s) * 1e6, 1),
        tokens=len(ids),
        instance_accepted=bool(ok),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib", choices=["llguidance", "xgrammar"])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tok = load_tokenizer(DEFAULT_TARGET)
    t0 = time.perf_counter()
    lib = LLGuidance(tok) if args.lib == "llguidance" else XGrammar(tok)
    print(json.dumps({"lib": args.lib, "tokenizer_s": round(time.perf_counter() - t0, 2)}))
    for name, (schema, instance) in SCHEMAS.items():
        print(json.dumps({"lib": args.lib, "schema": name, **measure(lib, tok, schema, instance, args.reps)}))


if __name__ == "__main__":
    main()
