"""Constrained decoding vs the same requests unconstrained, side by side in one run.

Builds chat requests that ask for JSON (several schemas: nested objects, enums,
arrays, required fields, bounded integers and strings, so a small model's answer ends), renders them with the model's chat template, and runs
them through the offline engine in one batch:

- constrained: each with its schema (xgrammar, the engine's bitmask), greedy;
  every answer must parse and validate against its schema;
- unconstrained: the same prompts, greedy, with ``max_tokens`` set to the
  length of that request's constrained answer and ``ignore_eos``, so both runs
  generate the same number of tokens per request and differ only in the mask.

Grammars are compiled before the timed run (a schema compiles once per worker;
``--cold`` times the compilation too).  Rounds alternate ABBA; output tok/s of
each run, each pair's ratio and the median are printed.

    python scripts/bench_structured.py [--requests 96] [--rounds 2] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jsonschema

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.pipeline.preprocess import render_prompt
from pagedq.pipeline.protocol import CHAT_URL, parse_request, to_sampling_params
from pagedq.workers.llm import LLM

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["happy", "sad", "calm"]},
                         "pets": {"type": "array", "maxItems": 2, "items": {
                             "type": "object", "additionalProperties": False, "required": ["kind", "name"],
                             "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                            "name": {"type": "string", "maxLength": 10}}}}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "capital", "population"],
        "properties": {"city": {"type": "string", "maxLength": 16}, "country": {"type": "string", "maxLength": 16},
                       "capital": {"type": "boolean"}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "delivery"],
         "properties": {"customer": {"type": "object", "additionalProperties": False, "required": ["name", "vip"],
                                     "properties": {"name": {"type": "string", "maxLength": 12},
                                                    "vip": {"type": "boolean"}}},
                        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"enum": ["tea", "coffee", "juice", "cake"]},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 20}}}},
                        "delivery": {"enum": ["pickup", "courier", "post"]}}}
TASKS = [
    (PERSON, "Describe {} as JSON: a person with a name, age, mood and pets."),
    (CITY, "Give facts about a city in {} as JSON."),
    (ORDER, "Write an order by a customer called {} as JSON."),
]
SUBJECTS = ["Ann", "Bob", "Carla", "Dmitri", "Eve", "Farah", "Goro", "Hana", "Spain", "Peru", "Japan", "Kenya",
            "Chile", "Norway", "Egypt", "India"]


def requests(n: int, max_tokens: int):
    out = []
    for i in range(n):
        schema, ask = TASKS[i % len(TASKS)]
        body = {"messages": [{"role": "user", "content": ask.format(SUBJECTS[(i // len(TASKS)) % len(SUBJECTS)])}],
                "temperature": 0, "max_tokens": max_tokens,
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
        out.append((schema, parse_request(CHAT_URL, body)))
    return out


def check(reqs, outs) -> int:
    """Every constrained answer ended on its own and validates against its schema; how many were checked."""
    for (schema, _), out in zip(reqs, outs, strict=True):
        assert out.finish_reason == "stop", f"cut at {len(out.output_token_ids)} tokens: {out.text!r}"
        jsonschema.validate(json.loads(out.text), schema)
    return len(outs)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def timed(engine: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--cold", action="store_true", help="do not compile the grammars before the timed runs")
    args = ap.parse_args()

    engine = LLM(Settings())
    reqs = requests(args.requests, args.max_tokens)
    prompts = [render_prompt(engine.tokenizer, r) for _, r in reqs]
    constrained = [to_sampling_params(r) for _, r in reqs]
    if not args.cold:
        for p in constrained:
            engine.engine.grammar_for(p)  # the compiler's cache keeps it

    # The constrained run sets each request's length; the unconstrained one generates as many tokens.
    _, first = timed(engine, prompts, constrained)
    lengths = [len(o.output_token_ids) for o in first]
    checked = check(reqs, first)
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    tokens = sum(lengths)

    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    order = ["constrained", "unconstrained", "unconstrained", "constrained"] * ((args.rounds + 1) // 2)
    for name in order[: 2 * args.rounds]:
        seconds, outs = timed(engine, prompts, constrained if name == "constrained" else free)
        assert sum(len(o.output_token_ids) for o in outs) == tokens
        if name == "constrained":
            checked += check(reqs, outs)
        runs[name].append(tokens / seconds)
        print(f"{name:>13}: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s", flush=True)

    ratios = [c / u for c, u in zip(runs["constrained"], runs["unconstrained"], strict=True)]
    print(f"\nmachine: {cpu_name()}, {args.requests} requests, {len(TASKS)} schemas, {tokens} output tokens a run; "
          f"every constrained answer parsed and validated ({checked} checked)")
    print(f"constrained / unconstrained tok/s per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f} (cost {1 - statistics.median(ratios):.1%})")


if __name__ == "__main__":
    main()
