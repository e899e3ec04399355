"""What one request may cost, and whose caches it may use, decided by the one schema (issue 48)."""

from __future__ import annotations

import json
import random

import pytest

from pagedq.config.messages import GenerateJob, check_stop_token_ids, parse_message, to_json
from pagedq.config.names import Names
from pagedq.config.sampling_params import SamplingParams
from pagedq.pipeline.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_OUTPUT_BUDGET,
    MAX_REGEX_EXPANSION,
    MAX_STOP_TOKEN_IDS,
    RequestError,
    parse_batch_line,
    parse_request,
    regex_expansion,
    scoped_cache_salt,
    to_sampling_params,
)
from pagedq.store.registry import worker_index_of
from pagedq.workers.engine.block_hash import cache_key, prefix_hashes


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": f"hello {random.random()}"}], **fields}


def refused(url: str, body: dict) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_request(url, body)
    return e.value


def test_stop_token_ids_at_most_64():
    ids = random.sample(range(1, 49152), MAX_STOP_TOKEN_IDS + 1)
    assert refused(CHAT_URL, chat(stop_token_ids=ids)).param == "stop_token_ids"
    params = to_sampling_params(parse_request(CHAT_URL, chat(stop_token_ids=ids[:-1])))
    assert params.stop_token_set == frozenset(ids[:-1])
    with pytest.raises(RequestError) as e:
        check_stop_token_ids(ids[:3] + [49152 + random.randrange(100)], 49152)
    assert e.value.param == "stop_token_ids"
    check_stop_token_ids(ids, 49152)


def test_logit_bias_at_most_300_entries():
    bias = {str(t): random.uniform(-100, 100) for t in random.sample(range(49152), MAX_LOGIT_BIAS + 1)}
    err = refused(COMPLETIONS_URL, {"prompt": "x", "logit_bias": bias})
    assert err.param == "logit_bias" and str(MAX_LOGIT_BIAS) in str(err)
    del bias[next(iter(bias))]
    assert len(to_sampling_params(parse_request(COMPLETIONS_URL, {"prompt": "x", "logit_bias": bias})).logit_bias) \
        == MAX_LOGIT_BIAS


def test_n_times_max_tokens_times_logprobs_within_the_budget():
    n = random.choice([64, 128])
    fits = MAX_OUTPUT_BUDGET // n
    parse_request(CHAT_URL, chat(n=n, max_tokens=fits))
    err = refused(CHAT_URL, chat(n=n, max_tokens=fits + 1))
    assert err.param == "max_tokens" and f"{MAX_OUTPUT_BUDGET:,}" in str(err)
    per_token = 21
    parse_request(CHAT_URL, chat(max_tokens=MAX_OUTPUT_BUDGET // per_token, logprobs=True, top_logprobs=20))
    assert refused(CHAT_URL, chat(max_completion_tokens=MAX_OUTPUT_BUDGET // per_token + 1, logprobs=True,
                                  top_logprobs=20)).param == "max_tokens"
    assert refused(COMPLETIONS_URL, {"prompt": "x", "n": 8, "logprobs": 20,
                                     "max_tokens": MAX_OUTPUT_BUDGET // (8 * per_token) + 1}).param == "max_tokens"
    line = json.dumps({"custom_id": "a", "url": CHAT_URL, "body": chat(n=n, max_tokens=fits + 1)})
    with pytest.raises(RequestError) as e:
        parse_batch_line(line)
    assert e.value.param == "max_tokens" and e.value.custom_id == "a"
    # one plain sequence is bounded by the model's context (its context_length_exceeded), not by the budget
    assert parse_request(CHAT_URL, chat(max_tokens=MAX_OUTPUT_BUDGET + random.randint(1, 10**6))).n == 1


def test_cache_salt_scopes_never_meet():
    salt = f"conversation-{random.randrange(1 << 30)}"
    a, b = scoped_cache_salt("tenant:a", None), scoped_cache_salt("tenant:b", None)
    assert a != b and a == scoped_cache_salt("tenant:a", None)
    assert scoped_cache_salt("tenant:a", salt) not in (a, b, scoped_cache_salt("tenant:b", salt))
    assert scoped_cache_salt("tenant:b", a) != a, "a salt copied from another scope lands elsewhere"
    for bad in ("", "x" * (MAX_CACHE_SALT + 1), 7, "\ud800"):
        assert scoped_cache_salt("tenant:a", bad) == bad  # left for the schema to name
        if isinstance(bad, str):
            assert refused(CHAT_URL, chat(cache_salt=bad)).param == "cache_salt"
    req = parse_request(CHAT_URL, chat(cache_salt=a, temperature=0))
    job = GenerateJob("j", "m", "chat", [1, 2], to_sampling_params(req), 5)
    assert parse_message(GenerateJob, to_json(job)).params.cache_salt == a  # crosses to the GPU worker


def test_salted_block_names_differ_from_the_first_block_on():
    ids = [random.randrange(1, 49152) for _ in range(100)]
    plain = prefix_hashes(ids, 16, cache_key("m", "fp"))
    salted = prefix_hashes(ids, 16, cache_key("m", "fp", "s1"))
    assert len(plain) == len(salted) == 6 and not set(plain) & set(salted)
    assert salted == prefix_hashes(ids, 16, cache_key("m", "fp", "s1"))


def test_the_workers_index_is_named_from_the_record_key():
    names = Names(key_prefix=f"p{random.randrange(1000)}worker:")
    host = f"gpu{random.randrange(9)}.1@host-{random.randrange(100)}"
    assert worker_index_of(names.worker(host)) == (names.workers_index, host)
    assert worker_index_of(names.model("m")) == ("", "")
    assert SamplingParams().stop_token_set == frozenset()


def test_regex_counted_repeats_are_bounded():
    n = random.randrange(MAX_REGEX_EXPANSION + 1, 4 * MAX_REGEX_EXPANSION)
    assert regex_expansion(f"x{{{n}}}") > MAX_REGEX_EXPANSION
    assert regex_expansion("(ab{64}){64}") > MAX_REGEX_EXPANSION  # nested repeats multiply
    assert regex_expansion(r"\d{4}-\d{2}-\d{2}") == 10 and regex_expansion(r"[{]{9}\{3\}") == 12
    assert refused(CHAT_URL, chat(structured_outputs={"regex": f"[a-z]{{{n}}}"})).param == "structured_outputs"
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(ab{64}){64}$"}},
              "required": ["code"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    assert refused(CHAT_URL, chat(response_format=fmt)).param == "response_format"
    schema["properties"]["code"]["pattern"] = r"^[A-Z]{3}-\d{4}$"
    assert parse_request(CHAT_URL, chat(response_format=fmt)).constraint[0] == "json_schema"
