"""The request schema: the one validation every path uses (no Redis, no model)."""

from __future__ import annotations

import json
import random

import pytest

from pagedq.config.messages import (
    GenerateJob,
    MalformedMessageError,
    RequestError,
    adapter_for,
    check_context,
    parse_message,
)
from pagedq.config.sampling_params import SamplingParams
from pagedq.pipeline.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    parse_batch_line,
    parse_request,
    read_batch_file,
    to_sampling_params,
)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 10**30}, "top_k"),
    ({"min_p": 1.2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 50}, "logprobs"),
    ({"seed": "abc"}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"priority": 10}, "priority"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "stream": True}, "echo"),
    ({"prompt": ["one", "two"]}, "prompt"),
])
def test_bad_fields_are_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError) as e:
        parse_request(COMPLETIONS_URL, {"prompt": "hi", **fields})
    assert e.value.param.split(".")[0] == param and str(e.value).startswith(param)


@pytest.mark.parametrize("where, body, param", [
    ("content", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    ("stop", {"messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}, "stop"),
    ("user", {"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"}, "user"),
    ("model", {"messages": [{"role": "user", "content": "hi"}], "model": "m\udc80"}, "model"),
])
def test_lone_surrogates_are_refused_naming_the_field(where, body, param):
    with pytest.raises(RequestError, match="surrogate") as e:
        parse_request(CHAT_URL, body)
    assert e.value.param is not None and e.value.param.startswith(param.split(".")[0])
    assert str(e.value).startswith(param)


def test_limits_that_the_engine_needs_are_accepted_at_their_edges():
    req = parse_request(COMPLETIONS_URL, {"prompt": [1, 2, 3], "seed": 2**63 - 1, "temperature": 1e-30,
                                          "top_k": 10**6, "max_tokens": 5})
    params = to_sampling_params(req)
    assert params.seed == 2**63 - 1 and params.greedy and params.top_k == 10**6


def test_generate_job_carries_typed_sampling_params_through_json():
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=random.randrange(1, 1 << 62), stop=["x"])
    job = GenerateJob("j1", "m", "text", [5, 6, 7], params, 3)
    back = parse_message(GenerateJob, json.loads(json.dumps(job, default=lambda o: o.__dict__)))
    assert back.params == params and isinstance(back.params, SamplingParams)
    with pytest.raises(MalformedMessageError, match="params"):
        parse_message(GenerateJob, {**json.loads(json.dumps(job, default=lambda o: o.__dict__)), "params": "x"})


def test_a_message_class_gets_one_validator_per_process(monkeypatch):
    """Building a validator generates the class's whole schema (milliseconds); every message paid it once."""
    import pagedq.config.messages as messages

    built = []
    real = messages.TypeAdapter
    monkeypatch.setattr(messages, "_adapters", {})
    monkeypatch.setattr(messages, "TypeAdapter", lambda cls: built.append(cls) or real(cls))
    payload = json.loads(json.dumps(GenerateJob("j", "m", "text", [random.randrange(1, 999)], SamplingParams(), 1),
                                    default=lambda o: o.__dict__))
    for _ in range(3):
        assert parse_message(GenerateJob, payload).job_id == "j"
    assert built == [GenerateJob] and adapter_for(GenerateJob) is adapter_for(GenerateJob)


def test_context_check_names_the_real_culprit():
    with pytest.raises(RequestError) as e:
        check_context([1] * 9001, 16, 8192, 100)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as e:
        check_context([1] * 100, 8100, 8192, 100)
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="token ids"):
        check_context([100], 1, 8192, 100)
    check_context([99] * 100, 8092, 8192, 100)  # fits exactly


def test_batch_lines_each_fail_alone(tmp_path):
    nested = '{"custom_id": "deep", "body": ' + "[" * 100000 + "]" * 100000 + "}"
    good = json.dumps({"custom_id": "ok", "url": CHAT_URL, "body": {"messages": [{"role": "user", "content": "x"}]}})
    surrogate = json.dumps({"custom_id": "\ud800", "url": COMPLETIONS_URL, "body": {"prompt": "x"}})
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"\n".join([nested.encode(), good.encode(), surrogate.encode(),
                                 b'{"custom_id": "bytes", "url": "/v1/completions", "body": {"prompt": "\xff\xfe"}}',
                                 b"   "]))
    lines = read_batch_file(path)
    assert len(lines) == 4
    errors = []
    for line in lines:
        try:
            custom_id, _, _ = parse_batch_line(line)
            assert custom_id == "ok"
        except RequestError as e:
            errors.append((e.custom_id, e.param))
    assert errors == [(None, "line"), (None, "custom_id"), ("bytes", "prompt")]


def test_jsonl_lines_split_on_newlines_only():
    from pagedq.pipeline.protocol import split_lines

    line = json.dumps({"custom_id": "a", "body": {"prompt": "one\u2028two\u0085three"}}, ensure_ascii=False)
    lines = split_lines((line + "\r\n\n" + line + "\n").encode())
    assert lines == [line, line] and json.loads(lines[0])["body"]["prompt"] == "one\u2028two\u0085three"


def test_prompt_scoring_fields():
    """echo / prompt_logprobs / max_tokens 0 map onto the engine's parameters; a list of one prompt is that
    prompt (lm-eval sends ``[[ids]]``); prompt_logprobs is a completions field only."""
    ids = [random.randrange(1, 30000) for _ in range(5)]
    req = parse_request(COMPLETIONS_URL, {"prompt": [ids], "echo": True, "logprobs": 2, "max_tokens": 0})
    params = to_sampling_params(req)
    assert req.prompt == ids and (params.max_tokens, params.echo, params.num_prompt_logprobs) == (0, True, 2)
    params = to_sampling_params(parse_request(COMPLETIONS_URL, {"prompt": ["hi"], "prompt_logprobs": 3,
                                                                "logprobs": 1}))
    assert (params.max_tokens, params.echo, params.num_prompt_logprobs) == (256, False, 3)
    with pytest.raises(RequestError) as e:
        parse_request(CHAT_URL, {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1})
    assert e.value.param == "prompt_logprobs"
