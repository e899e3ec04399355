"""Tools in the request schema, the prompt and the answer (``pipeline/tools.py``); the gateway's are tests/e2e."""

from __future__ import annotations

import json
import random
import string

import jsonschema
import pytest

from pagedq.config.messages import Completion, RequestError
from pagedq.pipeline.postprocess import build_response
from pagedq.pipeline.preprocess import chat_messages
from pagedq.pipeline.protocol import CHAT_URL, parse_request, request_body
from pagedq.pipeline.tools import parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
SMOL_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{% endfor %}"
TOOLS_TEMPLATE = SMOL_TEMPLATE + "{% if tools %}{{ tools }}{% endif %}"


def _word() -> str:
    return "".join(random.choices(string.ascii_lowercase, k=random.randint(3, 10)))


def _block(name: str, city: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"city": city}}) + "\n</tool_call>"


def chat(**fields):
    return parse_request(CHAT_URL, {"messages": [{"role": "user", "content": "Weather in Paris?"}], **fields})


def test_tool_choice_sets_parsing_and_constraint():
    assert chat().tool_parsing == "" and chat().constraint is None
    assert chat(tools=[WEATHER]).tool_parsing == "auto" and chat(tools=[WEATHER]).constraint is None
    assert chat(tools=[WEATHER], tool_choice="none").tool_parsing == ""
    named = chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_parsing == "function:get_weather"
    assert json.loads(named.constraint[1]) == WEATHER["function"]["parameters"]
    required = chat(tools=[WEATHER, CLOCK], tool_choice="required")
    schema = json.loads(required.constraint[1])
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": _word()}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).constraint[1])
    assert one["maxItems"] == 1
    assert "tools" in request_body(required) and request_body(required)["tool_choice"] == "required"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": [{"role": "tool", "content": "12C"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
])
def test_refused_tool_shapes_name_their_field(fields, param):
    with pytest.raises(RequestError) as e:
        chat(**fields)
    assert e.value.param == param, str(e.value)


def _history(city: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": answer}]


def test_templates_without_tools_get_the_hermes_format():
    city, answer = _word(), _word()
    req = parse_request(CHAT_URL, {"messages": _history(city, answer), "tools": [WEATHER]})
    messages = chat_messages(req, SMOL_TEMPLATE)
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert json.loads(messages[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0]) == WEATHER
    call = json.loads(messages[2]["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call == {"name": "get_weather", "arguments": {"city": city}}
    assert messages[3] == {"role": "user", "content": f"<tool_response>\n{answer}\n</tool_response>"}
    system = _word()
    with_system = parse_request(CHAT_URL, {"messages": [{"role": "system", "content": system}] + _history(city, answer),
                                           "tools": [WEATHER]})
    first = chat_messages(with_system, SMOL_TEMPLATE)[0]["content"]
    assert first.startswith(system + "\n\n") and "<tools>" in first
    none = parse_request(CHAT_URL, {"messages": _history(city, answer), "tools": [WEATHER], "tool_choice": "none"})
    assert all("<tools>" not in m["content"] for m in chat_messages(none, SMOL_TEMPLATE))


def test_templates_with_tools_get_them_natively():
    city, answer = _word(), _word()
    req = parse_request(CHAT_URL, {"messages": _history(city, answer), "tools": [WEATHER]})
    messages = chat_messages(req, TOOLS_TEMPLATE)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": city}}
    assert messages[2] == {"role": "tool", "content": answer, "tool_call_id": "call_1"}


def test_answers_become_tool_calls():
    city = _word()
    block = _block("get_weather", city)
    content, calls = parse_tool_calls("Let me look.\n" + block + "\n" + block.replace("get_weather", "get_time"),
                                      "auto")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": city}), ("get_time", {"city": city})]
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls(block.removesuffix("\n</tool_call>"), "auto")[1][0]["function"]["name"] == "get_weather"
    plain = f"It is sunny in {city}."
    assert parse_tool_calls(plain, "auto") == (plain, [])
    assert parse_tool_calls("<tool_call>{not json</tool_call>", "auto") == ("<tool_call>{not json</tool_call>", [])
    content, calls = parse_tool_calls(json.dumps({"city": city}), "function:get_weather")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": city}
    content, calls = parse_tool_calls(json.dumps([{"name": "get_time", "arguments": {}}]), "required")
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    # cut by max_tokens: a required or named choice still yields its calls, the cut one's arguments as written
    content, calls = parse_tool_calls(f'{{"city": "{city[:2]}', "function:get_weather")
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": f'{{"city": "{city[:2]}'}
    whole = json.dumps({"name": "get_time", "arguments": {"city": city}})
    content, calls = parse_tool_calls(f'[{whole}, {{"name": "get_weather", "arguments": {{"ci', "required")
    assert content is None and [c["function"] for c in calls] == [
        {"name": "get_time", "arguments": json.dumps({"city": city})},
        {"name": "get_weather", "arguments": '{"ci'}]
    assert parse_tool_calls('[{"name": "get_wea', "required") == ('[{"name": "get_wea', [])  # cut in the name


def test_the_response_carries_tool_calls_and_their_finish_reason():
    city = _word()
    text = _block("get_weather", city)
    c = Completion("j1", "chat", "m", text, [1, 2, 3], 7, "stop", tool_parsing="auto")
    choice = build_response(c, tokenizer=None)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": city}
    plain = build_response(Completion("j2", "chat", "m", text, [1], 7, "stop"), tokenizer=None)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": text}


def test_answers_that_cannot_be_calls_never_raise():
    deep = "<tool_call>" + "[" * 100_000
    assert parse_tool_calls(deep, "auto") == (deep, [])
    assert parse_tool_calls("[" * 100_000, "required")[1] == []
    assert parse_tool_calls("{" * 100_000, "function:f")[1][0]["function"]["arguments"] == "{" * 100_000
    surrogate = '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>'
    [call] = parse_tool_calls(surrogate, "auto")[1]
    call["function"]["arguments"].encode("utf-8")  # an escape, not a lone surrogate
    assert parse_tool_calls('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', "auto")[1] == []
    as_text = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": \\"\\ud800\\"}"}</tool_call>', "auto")
    as_text[1][0]["function"]["arguments"].encode("utf-8")
