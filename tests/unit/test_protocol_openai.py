"""The request schema for what real OpenAI clients send (issue 21): structured outputs, content parts, roles,
fields SDKs send by default.  No Redis, no model; xgrammar's tokenizer-free compiler checks constraints."""

from __future__ import annotations

import json
import random

import pytest

from pagedq.config.constraints import grammar_source
from pagedq.config.messages import GenerateJob, RequestError, parse_message, to_json
from pagedq.pipeline.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    cache_body,
    parse_batch_line,
    parse_request,
    request_body,
    to_sampling_params,
)
from pagedq.pipeline.structured_outputs import MAX_SCHEMA_DEPTH
from pagedq.store.result_cache import request_digest

HI = [{"role": "user", "content": "hi"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "mood": {"enum": ["happy", "sad"]}},
          "required": ["name", "mood"], "additionalProperties": False}


def chat(**fields):
    return parse_request(CHAT_URL, {"messages": HI, **fields})


def canonical(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))


@pytest.mark.parametrize("fields, constraint", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ["json_object", ""]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "P", "schema": PERSON}}},
     ["json_schema", canonical(PERSON)]),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "P", "description": "a person", "schema": PERSON, "strict": True}}}, ["json_schema", canonical(PERSON)]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}}, ["json_object", ""]),
    ({"structured_outputs": {"json": PERSON}}, ["json_schema", canonical(PERSON)]),
    ({"structured_outputs": {"json": json.dumps(PERSON, indent=2)}}, ["json_schema", canonical(PERSON)]),
    ({"structured_outputs": {"json_object": True}}, ["json_object", ""]),
    ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, ["regex", r"\d{3}-\d{4}"]),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ["choice", '["yes", "no"]']),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, ["grammar", 'root ::= "a" | "b"']),
    ({"guided_json": PERSON}, ["json_schema", canonical(PERSON)]),
    ({"guided_regex": "[a-z]+"}, ["regex", "[a-z]+"]),
    ({"guided_choice": ["red", "blue"]}, ["choice", '["red", "blue"]']),
    ({"guided_grammar": 'root ::= "x"'}, ["grammar", 'root ::= "x"']),
])
def test_each_structured_output_shape_becomes_one_constraint(fields, constraint):
    for url, base in ((CHAT_URL, {"messages": HI}), (COMPLETIONS_URL, {"prompt": "hi"})):
        req = parse_request(url, {**base, **fields})
        assert req.constraint == constraint
        params = to_sampling_params(req)
        assert params.constraint == constraint
        # It crosses processes as JSON: a GenerateJob carrying it parses back the same.
        job = GenerateJob("j", "m", "chat", [1, 2], params, 5)
        assert parse_message(GenerateJob, json.loads(json.dumps(to_json(job)))).params == params
        if constraint is not None:
            grammar_source(constraint)  # a kind the worker knows


def test_choice_grammar_escapes_quotes_and_backslashes():
    src = grammar_source(["choice", json.dumps(['say "hi"', "a\\b", "naïve"])])
    import xgrammar as xgr

    xgr.Grammar.from_ebnf(src.text)  # compiles: the literals are escaped
    assert src.method == "ebnf" and '"say \\"hi\\""' in src.text


def test_messages_as_real_sdks_send_them():
    req = parse_request(CHAT_URL, {"messages": [
        {"role": "developer", "content": "Answer in JSON."},
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}], "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}],
         "name": "alice"}],
        "max_completion_tokens": 7, "store": False, "metadata": {"run": "1"}, "service_tier": "auto",
        "prompt_cache_key": "k", "safety_identifier": "u-1", "user": "alice"})
    assert [m.role for m in req.messages] == ["developer", "system", "user"]
    assert req.messages[2].text == "line one\nline two" and req.messages[2].name == "alice"
    assert req.max_tokens == 7 and to_sampling_params(req).max_tokens == 7
    body = request_body(req)
    assert not {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                "max_completion_tokens"} & set(body)
    assert parse_request(CHAT_URL, body).max_tokens == 7  # what the CPU worker re-reads
    assert chat(max_tokens=3, max_completion_tokens=9).max_tokens == 3  # max_tokens wins, as the gateway did


def test_developer_role_renders_as_system_unless_the_template_knows_it():
    from pagedq.pipeline.preprocess import chat_messages

    req = parse_request(CHAT_URL, {"messages": [{"role": "developer", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "Hi"}],
                                                 "name": "bob"}]})
    assert chat_messages(req, "{{ message['role'] }}") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bob"}]
    assert chat_messages(req, "{% if message['role'] == 'developer' %}")[0]["role"] == "developer"


def test_logit_bias_reaches_the_sampling_params_as_token_ids():
    from pagedq.pipeline.protocol import to_sampling_params

    bias = {str(random.randrange(49152)): round(random.uniform(-100, 100), 3) for _ in range(5)}
    params = to_sampling_params(chat(logit_bias=bias))
    assert params.logit_bias == {int(k): v for k, v in bias.items()}
    assert to_sampling_params(chat()).logit_bias == {}
    from pagedq.config.sampling_params import SamplingParams

    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # a stage's copy comes through JSON


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 2, "stream": True}, "stream"),
    ({"logit_bias": {"42": -101}}, "logit_bias.42"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"dog": 1}}, "logit_bias"),
    ({"best_of": 2}, "best_of"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.1.type"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages.0.role"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"metadata": {"k": 1}}, "metadata.k"),
])
def test_refused_shapes_name_their_field(fields, param):
    with pytest.raises(RequestError) as e:
        chat(**fields)
    assert e.value.param == param, str(e.value)
    assert str(e.value).startswith(param + ":")


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _deep(MAX_SCHEMA_DEPTH)}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "long", "schema": {"type": "string", "maxLength": 10**9}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"guided_regex": "[z-a]"}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs"),
])
def test_constraints_that_cannot_compile_are_refused_at_submit(fields, param):
    for url, base in ((CHAT_URL, {"messages": HI}), (COMPLETIONS_URL, {"prompt": "hi"})):
        with pytest.raises(RequestError) as e:
            parse_request(url, {**base, **fields})
        assert e.value.param == param, str(e.value)


def test_a_batch_line_takes_the_new_fields():
    line = {"custom_id": "a", "url": CHAT_URL, "body": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "P", "schema": PERSON}}}}
    custom_id, req, _ = parse_batch_line(json.dumps(line))
    assert custom_id == "a" and req.max_tokens == 5 and req.constraint == ["json_schema", canonical(PERSON)]


def test_cache_key_holds_the_constraint_not_the_ignored_fields():
    def digest(**fields) -> str:
        return request_digest(CHAT_URL, cache_body(chat(temperature=0, **fields)))

    plain = digest()
    as_schema = digest(response_format={"type": "json_schema", "json_schema": {"name": "P", "schema": PERSON}})
    assert len({plain, as_schema, digest(response_format={"type": "json_object"}),
                digest(structured_outputs={"regex": "[a-z]+"}), digest(structured_outputs={"regex": "[a-y]+"})}) == 5
    # The guided_* alias is the same entry; properties in another order are another answer (written in order).
    assert digest(structured_outputs={"json": PERSON}) == digest(guided_json=json.loads(json.dumps(PERSON)))
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    assert digest(structured_outputs={"json": PERSON}) != digest(structured_outputs={"json": reordered})
    assert digest(store=True, metadata={"a": "b"}, service_tier="auto", prompt_cache_key="x",
                  safety_identifier="s") == plain


def test_old_generate_messages_without_a_constraint_still_parse():
    job = GenerateJob("j", "m", "chat", [1, 2], to_sampling_params(chat()), 5)
    raw = json.loads(json.dumps(to_json(job)))
    del raw["params"]["constraint"]
    assert parse_message(GenerateJob, raw).params.constraint is None


def test_to_json_is_asdict_without_sharing_the_message_containers():
    import dataclasses

    req = chat(max_tokens=random.randint(2, 64), temperature=round(random.uniform(0.1, 1.5), 3),
               stop=[f"s{random.randint(1, 999)}"], logit_bias={str(random.randint(1, 999)): 1.5},
               seed=random.randint(1, 10_000), response_format={"type": "json_object"})
    job = GenerateJob(f"j{random.randint(1, 10**9)}", "m", "chat", [random.randint(1, 999) for _ in range(7)],
                      to_sampling_params(req), random.randint(0, 9))
    got = to_json(job)
    assert json.dumps(got, sort_keys=True) == json.dumps(dataclasses.asdict(job), sort_keys=True)
    got["prompt_token_ids"].append(-1)  # a copy: the message keeps its own lists
    assert job.prompt_token_ids[-1] != -1
    assert parse_message(GenerateJob, json.loads(json.dumps(got))).params == job.params
