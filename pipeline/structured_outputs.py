"""Structured outputs in the request schema: ``response_format``, ``structured_outputs``, and the edge check.

Two spellings, one meaning:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
  {"name", "description"?, "schema"?, "strict"?}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON
  text), ``json_object``, ``regex``, ``choice``, ``grammar`` (EBNF), and the
  older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` fields as aliases (``GUIDED_ALIASES``).

JSON (schemas, ``json_object``, and the required / named tool choices) is
compact by default: no whitespace between tokens, ``,`` and ``:`` as
separators, so a small model spends no token on layout nor loops on it.
``structured_outputs.whitespace`` asks for ``"spaced"`` (``", "`` and
``": "``) or ``"any"`` (xgrammar's free whitespace) instead.

``constraint_of`` turns either into the ``[kind, text]`` pair the engine
takes (``pagedq.config.constraints``).  ``compile_error`` compiles it with
xgrammar's tokenizer-free ``Grammar`` (imported on first use, results cached),
after size and depth limits, so a constraint the worker cannot compile is
refused at submit with a 400 naming the field, never found out on the GPU.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from typing_extensions import NotRequired, TypedDict

from pagedq.config.constraints import canonical_json, grammar_source

MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON, a regex, a grammar
MAX_SCHEMA_DEPTH = 32  # nesting of the schema's JSON (objects and arrays)
MAX_CHOICES = 256
MAX_REPEAT = 4096  # minLength / maxItems / ...: a grammar repeats its item that many times
_REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[13:10:35] /project/cpp/x.cc:94: "

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class JsonSchemaSpec(TypedDict):
    """``response_format.json_schema``; without ``schema`` the answer is any JSON object."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: NotRequired[str | None]
    schema: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _spec_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class StructuredOutputsSpec(TypedDict, total=False):
    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    json: dict[str, Any] | str | None
    json_object: bool | None
    regex: str | None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None
    grammar: str | None
    whitespace: Literal["compact", "spaced", "any"] | None  # pagedq's: how json / json_object lay JSON out


def _exactly_one(spec: StructuredOutputsSpec) -> StructuredOutputsSpec:
    given = [k for k, v in spec.items() if v not in (None, False) and k != "whitespace"]
    if len(given) != 1:
        raise ValueError("give exactly one of json, json_object, regex, choice, grammar"
                         + (f" (got {', '.join(given)})" if given else ""))
    if spec.get("whitespace") is not None and given[0] not in ("json", "json_object"):
        raise ValueError("whitespace: only with json or json_object")
    return spec


StructuredOutputs = Annotated[StructuredOutputsSpec, AfterValidator(_exactly_one)]


BOTH_SPELLINGS = object()  # put in ``structured_outputs`` when guided_* fields came with it: refused, naming it


def move_guided_aliases(data: Any) -> Any:
    """A request body with vLLM's ``guided_*`` fields moved into ``structured_outputs`` (a new dict)."""
    if not isinstance(data, dict) or not any(k in data for k in GUIDED_ALIASES):
        return data
    data = dict(data)
    moved = {new: data.pop(old) for old, new in GUIDED_ALIASES.items() if old in data}
    moved = {k: v for k, v in moved.items() if v is not None}
    if moved:
        data["structured_outputs"] = moved if data.get("structured_outputs") is None else BOTH_SPELLINGS
    return data


def constraint_of(fmt: ResponseFormat | None, so: StructuredOutputsSpec | None) -> list[str] | None:
    """The ``[kind, text]`` constraint a request asks for, or None (free text)."""
    if fmt is not None and fmt.type == "json_object":
        return ["json_object", ""]
    if fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.get("schema")
        return ["json_object", ""] if schema is None else ["json_schema", canonical_json(schema)]
    if not so:
        return None
    layout = [so["whitespace"]] if so.get("whitespace") not in (None, "compact") else []
    if so.get("json") is not None:
        schema = so["json"]
        return ["json_schema", canonical_json(json.loads(schema) if isinstance(schema, str) else schema), *layout]
    if so.get("json_object"):
        return ["json_object", "", *layout]
    if so.get("regex") is not None:
        return ["regex", so["regex"]]
    if so.get("choice") is not None:
        return ["choice", json.dumps(so["choice"], ensure_ascii=False)]
    return ["grammar", so["grammar"]]


def check_constraint(constraint: list[str]) -> None:
    """Raise ValueError (the caller's field is named in the 400) unless the worker can compile it."""
    why = compile_error(*constraint)
    if why is not None:
        raise ValueError(why)


@functools.lru_cache(maxsize=1024)
def compile_error(kind: str, text: str, *layout: str) -> str | None:
    """Why ``[kind, text]`` would not compile (limits first, then xgrammar itself), or None."""
    if len(text) > MAX_SPEC_CHARS:
        return f"the {kind} is {len(text)} characters; at most {MAX_SPEC_CHARS}"
    if kind == "json_schema":
        why = _schema_limits(json.loads(text))
        if why:
            return why
    if kind == "choice" and any(not c for c in json.loads(text)):
        return "choice: the choices must be non-empty strings"
    import xgrammar as xgr  # here: torch and xgrammar load in the processes that see a constrained request

    src = grammar_source((kind, text, *layout))
    try:
        if src.method == "json_schema":
            xgr.Grammar.from_json_schema(src.text, any_whitespace=src.any_whitespace, separators=src.separators,
                                         strict_mode=src.strict)
        elif src.method == "regex":
            xgr.Grammar.from_regex(src.text)
        else:
            xgr.Grammar.from_ebnf(src.text)
    except Exception as e:  # noqa: BLE001 - any failure to compile is the request's fault
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"cannot compile the {kind}: {_SOURCE_PREFIX.sub('', first_line)[:300]}"
    return None


def _schema_limits(schema: Any) -> str | None:
    """Depth and repetition limits of a JSON schema (walked without recursion)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
        if isinstance(node, dict):
            for key in _REPEAT_KEYWORDS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPEAT:
                    return f"{key} {value} is above the limit of {MAX_REPEAT}"
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return None
