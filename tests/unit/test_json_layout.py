"""Constrained JSON is compact by default; ``structured_outputs.whitespace`` lays it out otherwise."""

from __future__ import annotations

import random

import pytest
import xgrammar as xgr
from xgrammar import testing

from pagedq.config.constraints import grammar_source
from pagedq.pipeline.protocol import CHAT_URL, ChatCompletionRequest, RequestError, parse_request
from pagedq.pipeline.tools import tool_constraint, tool_parsing

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}


def _accepts(constraint: list[str], text: str) -> bool:
    src = grammar_source(constraint)
    grammar = xgr.Grammar.from_json_schema(src.text, any_whitespace=src.any_whitespace, separators=src.separators,
                                           strict_mode=src.strict)
    return testing._is_grammar_accept_string(grammar, text)


def _constraint(**so) -> list[str]:
    body = {"messages": [{"role": "user", "content": "x"}], "structured_outputs": so}
    return parse_request(CHAT_URL, body).constraint


def test_json_is_compact_unless_asked_otherwise():
    n = random.randint(-999, 999)
    compact, spaced, free = f'{{"n":{n},"s":"a b"}}', f'{{"n": {n}, "s": "a b"}}', f'{{ "n" :\n {n} ,"s":"a b" }}'
    fmt = {"messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    default = parse_request(CHAT_URL, fmt).constraint
    assert len(default) == 2 and _accepts(default, compact) and not _accepts(default, spaced)
    assert _constraint(json=SCHEMA) == default
    assert _constraint(json=SCHEMA, whitespace="compact") == default
    laid_out = _constraint(json=SCHEMA, whitespace="spaced")
    assert laid_out[2] == "spaced" and _accepts(laid_out, spaced) and not _accepts(laid_out, compact)
    anything = _constraint(json=SCHEMA, whitespace="any")
    assert all(_accepts(anything, t) for t in (compact, spaced, free))
    assert _accepts(_constraint(json_object=True), '{"k":[1,2]}')
    assert not _accepts(_constraint(json_object=True), '{"k": [1, 2]}')


def test_required_tool_calls_are_compact_too():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]})
    constraint = tool_constraint(req.tools, tool_parsing(req.tools, req.tool_choice), True)
    assert _accepts(constraint, '[{"name":"f","arguments":{"n":1,"s":""}}]')
    assert not _accepts(constraint, '[{"name": "f", "arguments": {"n": 1, "s": ""}}]')


@pytest.mark.parametrize("so", [{"regex": "a+", "whitespace": "any"}, {"whitespace": "spaced"},
                                {"json": SCHEMA, "whitespace": "tabs"}])
def test_whitespace_only_with_json(so):
    with pytest.raises(RequestError) as e:
        _constraint(**so)
    assert e.value.param.startswith("structured_outputs")
