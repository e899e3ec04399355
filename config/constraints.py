"""A structured-output constraint as it travels: ``[kind, text]``, and what grammar it stands for.

The request schema (``pagedq.pipeline.structured_outputs``) turns
``response_format`` / ``structured_outputs`` into one constraint, a JSON-safe
pair carried by ``SamplingParams.constraint``:

    ["json_schema", <the schema as compact JSON, keys in their order>(, <whitespace>)]
    ["json_object", ""]                      any JSON object
    ["regex", <pattern>]
    ["choice", <JSON list of strings>]       exactly one of them
    ["grammar", <EBNF, xgrammar's dialect>]

``grammar_source`` is the one translation into what xgrammar compiles; the
edge check (tokenizer-free) and the GPU worker (with the tokenizer) both use
it, so a constraint that passed at the edge compiles the same grammar there.
No xgrammar import here: this module is a contract.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# OpenAI's json_object: any object, with whatever properties (strict mode would allow only ``{}``).
ANY_OBJECT_SCHEMA = '{"type":"object"}'


# JSON between its tokens (json_schema, json_object): none (the default: no token spent on layout), one space
# after "," and ":", or xgrammar's free whitespace.  Carried as an optional third item of the constraint.
WHITESPACE = ("compact", "spaced", "any")
_SEPARATORS = {"compact": (",", ":"), "spaced": (", ", ": "), "any": None}


@dataclass(frozen=True)
class GrammarSource:
    """What xgrammar compiles: ``method`` is "json_schema", "regex" or "ebnf"."""

    method: str
    text: str
    strict: bool = True  # json_schema only: objects allow no properties beyond those named
    whitespace: str = "compact"  # json_schema only: one of WHITESPACE

    @property
    def any_whitespace(self) -> bool:
        return self.whitespace == "any"

    @property
    def separators(self) -> tuple[str, str] | None:
        return _SEPARATORS[self.whitespace]


def canonical_json(value) -> str:
    """No spaces, keys in the order given: one text per schema, so caches keyed on it hit.  Not sorted: the
    order of a schema's ``properties`` is the order the answer writes them in."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose only sentences are ``choices`` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_source(constraint: list[str] | tuple[str, ...]) -> GrammarSource:
    """``[kind, text]``, or ``[kind, text, whitespace]`` for JSON laid out other than compact."""
    kind, text, *rest = constraint
    whitespace = rest[0] if rest else "compact"
    if whitespace not in WHITESPACE or len(rest) > 1:
        raise ValueError(f"unknown JSON whitespace {rest!r}; expected one of {', '.join(WHITESPACE)}")
    if kind == "json_schema":
        return GrammarSource("json_schema", text, whitespace=whitespace)
    if kind == "json_object":
        return GrammarSource("json_schema", ANY_OBJECT_SCHEMA, strict=False, whitespace=whitespace)
    if kind == "regex":
        return GrammarSource("regex", text)
    if kind == "choice":
        return GrammarSource("ebnf", choice_ebnf(json.loads(text)))
    if kind == "grammar":
        return GrammarSource("ebnf", text)
    raise ValueError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}")
