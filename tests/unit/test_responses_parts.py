"""The Responses API's pure parts: items to chat messages, the chat body, field names in errors, output items."""

from __future__ import annotations

import json
import random
import string

import pytest

from pagedq.config.messages import RequestError
from pagedq.pipeline.gateway.responses_input import (
    as_responses_error,
    chat_body,
    output_items,
    parse_responses_request,
    stored_items,
    to_messages,
    usage_of,
)
from pagedq.pipeline.protocol import CHAT_URL, parse_request


def _word() -> str:
    return "".join(random.choices(string.ascii_lowercase, k=random.randint(3, 10)))


def test_items_become_chat_messages_the_schema_accepts():
    city, answer, said = _word(), _word(), _word()
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "priority": 3,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": said}]},
                      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                       "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                       "arguments": json.dumps({"city": city})},
                      {"type": "function_call_output", "call_id": "call_1", "output": answer}]}
    req, items = parse_responses_request(body)
    messages = to_messages(req.instructions, items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == said and messages[3] == {"role": "tool", "tool_call_id": "call_1",
                                                              "content": answer}
    assert messages[2]["content"] == "Let me look." and messages[2]["tool_calls"][0]["id"] == "call_1"
    chat = chat_body(req, items, 5)
    assert (chat["max_tokens"], chat["priority"], chat["tool_choice"]) == (7, 3, {"type": "function",
                                                                               "function": {"name": "get_weather"}})
    assert chat["response_format"]["json_schema"] == {"name": "x", "schema": {"type": "object"}}
    parsed = parse_request(CHAT_URL, {**chat, "response_format": None})  # a tool choice excludes a format
    assert parsed.tool_parsing == "function:get_weather"
    assert [i["id"] for i in stored_items(items)][1] == "msg_1"
    assert stored_items(items)[0]["content"] == [{"type": "input_text", "text": said}]


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "reasoning"}]}, "input.0.type"),
    ({"input": [{"type": 5}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "c"}, "conversation"),
    ({}, "input"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(RequestError) as e:
        parse_responses_request(body)
    assert e.value.param.startswith(param)


def test_chat_errors_are_named_as_the_responses_field():
    req, items = parse_responses_request({"input": "x", "max_output_tokens": 0})
    with pytest.raises(RequestError) as e:
        parse_request(CHAT_URL, chat_body(req, items, 5))
    err = as_responses_error(e.value)
    assert err.param == "max_output_tokens" and str(err).startswith("max_output_tokens:")


def test_output_items_and_usage_from_the_chat_completion():
    job, text = _word(), _word()
    result = {"choices": [{"message": {"role": "assistant", "content": text, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    items = output_items(job, result)
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[0]["id"] == f"msg_{job}" and items[0]["content"][0]["text"] == text
    assert items[1] == {"id": f"fc_{job}_0", "type": "function_call", "call_id": "call_9", "name": "f",
                        "arguments": "{}", "status": "completed"}
    assert usage_of(result["usage"])["input_tokens"] == 5 and usage_of(None) is None
