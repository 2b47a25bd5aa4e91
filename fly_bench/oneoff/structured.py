"""Structured output under speculation: 5 JSON schemas x N requests in every mode, each output
parsed and validated against its schema (an output cut by max_tokens counts as invalid), and the
speed of fly over ar with the schema and without it (the same prompts, the schema then only
described in the prompt).

    python -m fly_bench.oneoff.structured --requests 40 --out bench_out/structured.json
    python -m fly_bench.oneoff.structured --tiny          # tiny random models: a check in seconds

Goal (issue 22): 0 invalid outputs in every mode; fly's speedup over ar under a schema at least
80% of its unconstrained speedup (`speedup_kept`). Nothing here is asserted.
"""

import argparse
import itertools
import json

import jsonschema

from fly_bench.timing import timed
from fly_serve.build import build_engine
from fly_serve.engine.prompts import chat_prompt

NAME = {"type": "string", "minLength": 1, "maxLength": 30}
ADDRESS = {
    "type": "object",
    "properties": {"city": NAME, "country": NAME},
    "required": ["city", "country"],
    "additionalProperties": False,
}
# Bounded everywhere (string lengths, array sizes, integer ranges, $ref without recursion), so
# that even a random model ends every one within max_tokens.
SCHEMAS = {
    "person": {  # nested objects, integer range
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "address": ADDRESS},
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "order": {  # array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"product": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "review": {  # enums, boolean
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
            "stars": {"enum": [1, 2, 3, 4, 5]},
            "recommend": {"type": "boolean"},
        },
        "required": ["sentiment", "stars", "recommend"],
        "additionalProperties": False,
    },
    "event": {  # pattern, anyOf with null
        "type": "object",
        "properties": {
            "title": NAME,
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "location": {"anyOf": [NAME, {"type": "null"}]},
        },
        "required": ["title", "date", "location"],
        "additionalProperties": False,
    },
    "trip": {  # $ref to a shared definition
        "type": "object",
        "$defs": {"place": ADDRESS},
        "properties": {"from": {"$ref": "#/$defs/place"}, "to": {"$ref": "#/$defs/place"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
}
TOPICS = {
    "person": ["a famous scientist", "a fictional detective", "a chef", "an astronaut", "a painter"],
    "order": ["a grocery run", "office supplies", "a bakery order", "camping gear", "a bookshop order"],
    "review": ["a noisy hotel", "a great pizza", "a slow laptop", "a calm museum", "an average film"],
    "event": ["a product launch", "a wedding", "a chess final", "a code review", "a concert"],
    "trip": ["a trip across Europe", "a flight to Asia", "a train ride", "a road trip", "a ferry crossing"],
}
MODES = ["ar", "spd", "fly", "pld", "suffix", "recycle"]


def prompt_text(schema_name: str, topic: str) -> str:
    schema = json.dumps(SCHEMAS[schema_name])
    return f"Reply with only a JSON object, matching this JSON schema: {schema}\nThe JSON describes {topic}."


def requests_for(n: int, schemas=tuple(SCHEMAS)) -> list[tuple[str, str]]:
    """n (schema, topic) pairs per schema, topics cycled."""
    return [(s, t) for s in schemas for t in itertools.islice(itertools.cycle(TOPICS[s]), n)]


def is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_mode(engine, tok, cases, mode: str, constrained: bool, args) -> dict:
    """Every case through one mode, `batch` requests at a time; the figures summed."""
    base = dict(mode=mode, max_tokens=args.max_tokens, temperature=args.temperature)
    if mode != "ar":
        base["k"] = args.k
    tokens = wall = invalid = truncated = drafted = accepted = cut = 0
    texts = set()  # distinct outputs: at T = 0 the requests of one (schema, topic) repeat
    for start in range(0, len(cases), args.batch):
        chunk = cases[start : start + args.batch]
        prompts = [chat_prompt(tok, prompt_text(s, t)) for s, t in chunk]
        params = [  # a seed per request: at T > 0 the requests of one (schema, topic) differ
            base
            | {"seed": start + i}
            | (
                {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[s]}}}
                if constrained
                else {}
            )
            for i, (s, _) in enumerate(chunk)
        ]
        for (s, _), t in zip(chunk, timed(engine, prompts, params)):
            tokens, wall = tokens + t.tokens, wall + t.wall_s
            drafted, accepted, cut = drafted + t.drafted, accepted + t.accepted, cut + t.grammar_cut
            truncated += t.finish_reason == "length"
            invalid += not is_valid(t.text, SCHEMAS[s])
            texts.add(t.text)
    return dict(
        mode=mode,
        constrained=constrained,
        wall_s=round(wall, 2),
        requests=len(cases),
        invalid=invalid,
        distinct=len(texts),
        truncated=truncated,
        tokens=tokens,
        tok_s=round(tokens / wall, 2) if wall else 0.0,
        acceptance=round(accepted / drafted, 3) if drafted else None,
        grammar_cut=cut,  # drafts the grammar refused: a drafter under the grammar leaves none of its own
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40, help="requests per schema and mode (5 schemas)")
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--k", default="10", help='drafts per round, or "auto"')
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1, help="requests per engine batch")
    ap.add_argument("--speed-requests", type=int, default=None, help="per schema, for the fly/ar speed runs")
    ap.add_argument("--speed-batch", type=int, default=1, help="requests per engine batch in the fly/ar speed runs")
    ap.add_argument("--speed-temperature", type=float, default=0.0, help="temperature of the fly/ar speed runs")
    ap.add_argument("--schemas", nargs="+", default=list(SCHEMAS), choices=list(SCHEMAS))
    ap.add_argument("--tiny", action="store_true", help="tiny random models: a check of the script in seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.k = args.k if args.k == "auto" else int(args.k)
    if args.tiny:
        engine = build_engine("tiny:0", "tiny:1", max_batch=max(8, args.batch), max_model_len=2048)
        args.requests, args.max_tokens, args.k = 1, 120, 3
        args.schemas = ["review", "event"]  # the short ones: a random model writes 30-byte strings
    else:
        engine = build_engine(max_batch=max(8, args.batch))
    tok = engine.tokenizer
    cases = requests_for(args.requests, args.schemas)
    rows = []
    for m in args.modes:
        rows.append(run_mode(engine, tok, cases, m, True, args))
        print(json.dumps(rows[-1]), flush=True)
    # Speed: fly and ar on the same prompts, with the schema and without it, `speed_batch` at a time
    speed_cases = requests_for(args.speed_requests or args.requests, args.schemas)
    speed = {}
    speed_args = argparse.Namespace(**{**vars(args), "batch": args.speed_batch, "temperature": args.speed_temperature})
    for m in ("ar", "fly"):
        for c in (True, False):
            same = c and speed_cases == cases and vars(speed_args) == vars(args)  # the run above is this run
            done = next((r for r in rows if r["mode"] == m), None) if same else None
            speed[(m, c)] = done or run_mode(engine, tok, speed_cases, m, c, speed_args)
            print(json.dumps(speed[(m, c)]), flush=True)
    summary = dict(invalid_per_mode={r["mode"]: r["invalid"] for r in rows})
    ratio = {c: speed[("fly", c)]["tok_s"] / max(speed[("ar", c)]["tok_s"], 1e-9) for c in (True, False)}
    summary |= dict(
        speedup_constrained=round(ratio[True], 3),
        speedup_unconstrained=round(ratio[False], 3),
        speedup_kept=round(ratio[True] / ratio[False], 3) if ratio[False] else None,
    )
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, speed=[speed[k] for k in speed], summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
