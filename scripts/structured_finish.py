"""How often a constrained JSON answer of the default model ends on its own within a token budget.

Sends JSON-schema chat requests the way a new user's code does (pydantic-style
schemas: plain ``str`` / ``int`` / ``bool`` / ``list[str]`` / enum fields, no
length bounds; the SDK's default sampling, temperature 1, seeded per request)
through the offline engine in one batch, and counts the answers that finish
with ``stop`` and parse.  The few cut answers are printed.

    python scripts/structured_finish.py [--requests 200] [--max-tokens 96] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import jsonschema

from pagedq.config import Settings
from pagedq.pipeline.preprocess import render_prompt
from pagedq.pipeline.protocol import CHAT_URL, parse_request, to_sampling_params
from pagedq.workers.llm import LLM


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
TASKS = [
    (_obj({"name": STR, "age": INT, "city": STR}), "Describe a person called {} as JSON."),
    (_obj({"title": STR, "ingredients": {"type": "array", "items": STR}, "minutes": INT}),
     "Give a recipe from {} as JSON."),
    (_obj({"city": STR, "country": STR, "capital": BOOL}), "Give facts about a city in {} as JSON."),
    (_obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "reason": STR}),
     "Classify the sentiment of: 'I visited {} and loved it.' Answer as JSON."),
    (_obj({"title": STR, "author": STR, "year": INT}), "Name a book about {} as JSON."),
]
SUBJECTS = ["Ann", "Bob", "Carla", "Dmitri", "Eve", "Farah", "Goro", "Hana", "Spain", "Peru", "Japan", "Kenya",
            "Chile", "Norway", "Egypt", "India", "Mexico", "Italy", "Laos", "Oman"]


def requests(n: int, max_tokens: int, temperature: float) -> list[tuple[dict, object]]:
    out = []
    for i in range(n):
        schema, ask = TASKS[i % len(TASKS)]
        body = {"messages": [{"role": "user", "content": ask.format(SUBJECTS[(i // len(TASKS)) % len(SUBJECTS)])}],
                "temperature": temperature, "seed": i, "max_tokens": max_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
        out.append((schema, parse_request(CHAT_URL, body)))
    return out


def parses(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    engine = LLM(Settings())
    reqs = requests(args.requests, args.max_tokens, args.temperature)
    prompts = [render_prompt(engine.tokenizer, r) for _, r in reqs]
    start = time.perf_counter()
    outs = engine.generate(prompts, [to_sampling_params(r) for _, r in reqs])
    seconds = time.perf_counter() - start
    good = [o.finish_reason == "stop" and parses(o.text, s) for (s, _), o in zip(reqs, outs, strict=True)]
    reasons = Counter(o.finish_reason for o in outs)
    tokens = [len(o.output_token_ids) for o in outs]
    print(f"{sum(good)}/{len(outs)} = {sum(good) / len(outs):.1%} finished with stop and parsed "
          f"(finish reasons {dict(reasons)}; {sum(tokens) / len(tokens):.1f} tokens an answer; {seconds:.0f} s)")
    for o in [o for o, g in zip(outs, good, strict=True) if not g][:5]:
        print(f"  cut ({o.finish_reason}, {len(o.output_token_ids)} tokens): {o.text[:300]!r}")


if __name__ == "__main__":
    main()
