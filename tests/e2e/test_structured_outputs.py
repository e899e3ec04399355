"""Structured outputs end to end: the official ``openai`` SDK against ``pagedq serve``, the Python ``Client``,
the Batches API and ``run-batch`` (through the queue and ``--offline``), on real workers and SmolLM2-135M.

Greedy decoding; schemas are bounded (enums, maxLength, maxItems) so the model
finishes within max_tokens.  Every answer must parse and validate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import queue_helpers
from pydantic import BaseModel, Field

from pagedq.config import Settings
from pagedq.pipeline.local.stack import settings_env
from pagedq.pipeline.queued_batch import run_queued
from pagedq.workers.processes import free_port, spawn, stop

TIMEOUT = 180
CHAT = "/v1/chat/completions"


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=10)


class Person(BaseModel):
    name: str = Field(max_length=12)
    mood: Literal["happy", "sad", "calm"]
    pets: list[Pet] = Field(max_length=2)


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "capital"],
        "properties": {"city": {"type": "string", "maxLength": 16}, "country": {"type": "string", "maxLength": 16},
                       "capital": {"type": "boolean"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["item", "size", "extras"],
         "properties": {"item": {"enum": ["coffee", "tea", "juice"]}, "size": {"enum": ["small", "large"]},
                        "extras": {"type": "array", "maxItems": 2,
                                   "items": {"type": "object", "additionalProperties": False, "required": ["name"],
                                             "properties": {"name": {"enum": ["milk", "sugar", "ice"]}}}}}}


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="pso:", queue_prefix="pso.", max_num_seqs=32,
                    kv_cache_memory="256MiB", progress_interval_s=0.5)


@pytest.fixture(scope="module")
def gateway(settings, stack, tmp_path_factory) -> str:
    """A `pagedq serve` process (no API keys file: loopback, no auth) in front of the module's workers."""
    folder = tmp_path_factory.mktemp("gateway")
    port = free_port()
    env = {**os.environ, **settings_env(settings), "PAGEDQ_BROKER_URL": stack.url}
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--port", str(port)],
                 folder / "gateway.log", env)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, (folder / "gateway.log").read_text()
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        queue_helpers.wait_until(healthy, 60, 0.2, "the gateway to answer /health")
        yield base
    finally:
        stop(proc, 30)


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def test_openai_sdk_parse_returns_the_pydantic_model(gateway, settings):
    api = sdk(gateway)
    messages = [{"role": "developer", "content": "Reply with JSON only."},
                {"role": "user", "content": [{"type": "text", "text": "Describe Ann, who has a cat."}], "name": "u1"}]
    done = api.beta.chat.completions.parse(model=settings.model, messages=messages, response_format=Person,
                                           temperature=0, max_completion_tokens=120, store=False,
                                           metadata={"test": "parse"})
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed

    # The same request streamed: the deltas join to the same JSON.
    chunks = api.chat.completions.create(model=settings.model, messages=messages, temperature=0, stream=True,
                                         max_completion_tokens=120,
                                         response_format=schema_format("Person", Person.model_json_schema()))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Person.model_validate_json(text)

    # A text completion with vLLM's spelling.
    choice = api.completions.create(model=settings.model, prompt="Is water wet? Answer:", temperature=0,
                                    max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")


def test_a_schema_that_cannot_compile_is_a_400_naming_response_format(gateway, settings):
    api = sdk(gateway)
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=settings.model, messages=[{"role": "user", "content": "hi"}],
                                    response_format=schema_format("Bad", {"type": "object", "properties": {
                                        "a": {"$ref": "#/$defs/nowhere"}}}))
    assert e.value.param == "response_format"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=settings.model, messages=[{"role": "user", "content": "hi"}],
                                    tools=[bad_tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=settings.model, messages=[{"role": "user", "content": "hi"}],
                                    functions=[bad_tool["function"]])
    assert e.value.param == "functions"


def test_python_client_and_the_result_cache(client, settings):
    messages = [{"role": "user", "content": "Give a city in Italy as JSON."}]
    job = client.submit(messages, response_format=schema_format("City", CITY), temperature=0,
                        max_completion_tokens=80)
    result = client.result(job, timeout=TIMEOUT)
    jsonschema.validate(json.loads(result["choices"][0]["message"]["content"]), CITY)

    def resubmitted() -> dict | None:  # the answer is filed just after it is published: ask until it is there
        again = client.result(client.submit(messages, response_format=schema_format("City", CITY), temperature=0,
                                            max_completion_tokens=80, store=True), timeout=TIMEOUT)
        return again if again.get("cached") else None
    again = queue_helpers.wait_until(resubmitted, 60, 0.2, "the answer to come from the result cache")
    assert again["choices"] == result["choices"]
    # spaced: this prompt's greedy compact json_object nests on without end (docs/http.md, structured outputs)
    other = client.result(client.submit(messages, structured_outputs={"json_object": True, "whitespace": "spaced"},
                                        temperature=0, max_completion_tokens=80), timeout=TIMEOUT)
    assert not other.get("cached")
    assert isinstance(json.loads(other["choices"][0]["message"]["content"]), dict)


BATCH = [  # (custom_id, body, check of the content)
    *[(f"person-{i}", {"messages": [{"role": "user", "content": f"Describe {name} as JSON."}],
                       "response_format": schema_format("Person", Person.model_json_schema())},
       lambda t: Person.model_validate_json(t)) for i, name in enumerate(["Ann", "Bob", "Carla"])],
    *[(f"city-{i}", {"messages": [{"role": "user", "content": f"Give a city in {land} as JSON."}],
                     "response_format": schema_format("City", CITY)},
       lambda t: jsonschema.validate(json.loads(t), CITY)) for i, land in enumerate(["Spain", "Peru", "Japan"])],
    *[(f"order-{i}", {"messages": [{"role": "user", "content": f"Order {what} as JSON."}],
                      "structured_outputs": {"json": ORDER}},
       lambda t: jsonschema.validate(json.loads(t), ORDER)) for i, what in enumerate(["a tea", "iced coffee"])],
    ("object", {"messages": [{"role": "user", "content": "Reply with a JSON object with the keys name and age for Bob."}],
                "response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    ("choice", {"messages": [{"role": "user", "content": "Is fire cold?"}], "guided_choice": ["yes", "no"]},
     lambda t: t in ("yes", "no") or pytest.fail(t)),
]


def batch_lines() -> list[str]:
    return [json.dumps({"custom_id": cid, "method": "POST", "url": CHAT,
                        "body": {**body, "temperature": 0, "max_completion_tokens": 120}}) for cid, body, _ in BATCH]


def check_batch_output(lines: list[dict]) -> list[str]:
    """Every line completed, with content that parses and validates; the contents, in order."""
    assert [x["custom_id"] for x in lines] == [cid for cid, _, _ in BATCH]
    contents = []
    for line, (cid, _, check) in zip(lines, BATCH, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", (cid, choice)
        check(choice["message"]["content"])
        contents.append(choice["message"]["content"])
    return contents


def test_batches_api_and_run_batch_outputs_all_parse_and_validate(gateway, settings, tmp_path):
    api = sdk(gateway)
    data = ("\n".join(batch_lines()) + "\n").encode()
    upload = api.files.create(file=("structured.jsonl", data), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    done = queue_helpers.wait_until(
        lambda: (b := api.batches.retrieve(batch.id)).status in ("completed", "failed", "cancelled") and b,
        TIMEOUT * 2, 0.5, "the batch to end")
    assert (done.status, done.request_counts.completed) == ("completed", len(BATCH))
    via_api = check_batch_output([json.loads(x) for x in api.files.content(done.output_file_id).text.splitlines()])

    (tmp_path / "in.jsonl").write_bytes(data)
    run_queued(tmp_path / "in.jsonl", tmp_path / "queued.jsonl", settings, progress=False)
    queued = [json.loads(x) for x in (tmp_path / "queued.jsonl").read_text().splitlines()]
    assert check_batch_output(queued) == via_api

    env = {**os.environ, **settings_env(settings), "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "--offline", "-i",
                    str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "offline.jsonl")], env=env, check=True,
                   timeout=600)
    offline = [json.loads(x) for x in (tmp_path / "offline.jsonl").read_text().splitlines()]
    assert check_batch_output(offline) == via_api


# --- tools -----------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 16}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def check_calls(calls) -> list[tuple[str, dict]]:
    """Every call names a declared function and its arguments validate; (name, arguments) of each."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_openai_sdk_tool_calls_named_required_streamed_and_a_round_trip(gateway, settings):
    api = sdk(gateway)
    ask = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    named = api.chat.completions.create(model=settings.model, messages=ask, tools=[WEATHER, CLOCK], temperature=0,
                                        max_tokens=60, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, args)] = check_calls(choice.message.tool_calls)
    assert name == "get_weather"

    required = api.chat.completions.create(model=settings.model, messages=ask, tools=[WEATHER, CLOCK],
                                           tool_choice="required", temperature=0, max_tokens=120,
                                           parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(required.choices[0].message.tool_calls)) == 1

    chunks = list(api.chat.completions.create(
        model=settings.model, messages=ask, tools=[WEATHER, CLOCK], temperature=0, max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert check_calls(deltas[0].tool_calls) == [(name, args)], "streamed as answered"

    # The round trip: the call and its result go back in the history; the answer is text (tool_choice none).
    history = ask + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "21 C, sunny"}]
    answer = api.chat.completions.create(model=settings.model, messages=history, tools=[WEATHER, CLOCK],
                                         tool_choice="none", temperature=0, max_tokens=30)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    auto = api.chat.completions.create(model=settings.model, messages=history, tools=[WEATHER, CLOCK],
                                       temperature=0, max_tokens=60)
    message = auto.choices[0].message
    assert message.content or message.tool_calls
    if message.tool_calls:
        check_calls(message.tool_calls)


def test_logit_bias_forces_a_token_through_the_gateway(gateway, settings):
    import random

    api = sdk(gateway)
    token = random.randrange(1000, 40000)
    done = api.chat.completions.create(model=settings.model, messages=[{"role": "user", "content": "Hello"}],
                                       temperature=0, max_tokens=4, logprobs=True, logit_bias={str(token): 100})
    tokens = [t.token for t in done.choices[0].logprobs.content]
    assert len(tokens) == 4 and len(set(tokens)) == 1, tokens
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=settings.model, messages=[{"role": "user", "content": "Hello"}],
                                    logit_bias={"99999999": 5})
    assert e.value.param == "logit_bias"


# --- real client libraries, unmodified -------------------------------------------------------------------
def test_instructor_extracts_a_pydantic_model_in_tools_and_json_schema_modes(gateway, settings):
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(sdk(gateway), mode=mode)
        person = client.chat.completions.create(
            model=settings.model, response_model=Person, max_retries=0, temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": "Extract: Ann is happy and has a cat named Tom."}])
        assert isinstance(person, Person), mode


def test_langchain_chat_openai_invoke_stream_batch_structured_output_and_tools(gateway, settings):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=settings.model, base_url=f"{gateway}/v1", api_key="none", temperature=0, max_tokens=24,
                     max_retries=0, timeout=TIMEOUT)
    said = llm.invoke("Say hello.")
    assert said.content
    streamed = "".join(chunk.content for chunk in llm.stream("Say hello."))
    assert streamed == said.content
    assert [m.content for m in llm.batch(["Say hello.", "Say hello."])] == [said.content] * 2

    structured = ChatOpenAI(model=settings.model, base_url=f"{gateway}/v1", api_key="none", temperature=0,
                            max_tokens=120, max_retries=0, timeout=TIMEOUT).with_structured_output(Person)
    assert isinstance(structured.invoke("Describe Bob, who is calm and has a dog."), Person)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"21 C and sunny in {city}"

    with_tools = ChatOpenAI(model=settings.model, base_url=f"{gateway}/v1", api_key="none", temperature=0,
                            max_tokens=60, max_retries=0, timeout=TIMEOUT).bind_tools([get_weather],
                                                                                      tool_choice="get_weather")
    history = [HumanMessage("What is the weather in Paris?")]
    called = with_tools.invoke(history)
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    assert isinstance(called.tool_calls[0]["args"]["city"], str)
    history += [called, ToolMessage(get_weather.invoke(called.tool_calls[0]["args"]),
                                    tool_call_id=called.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert answer.content or answer.tool_calls


def test_n_choices_share_one_prompt_computation(gateway, settings):
    """n=4: four choices, and the worker's prefix-cache counter shows choices 1-3 took the prompt's blocks."""
    import random

    from pagedq.config.names import Names
    from pagedq.store.connection import redis_client

    api = sdk(gateway)
    r, names = redis_client(settings.broker_url), Names.from_settings(settings)

    def prefix_hits() -> int:
        return sum(int(r.hget(key, "prefix_hits") or 0) for key in r.scan_iter(names.worker_pattern))
    words = " ".join(random.choice(["queue", "token", "cache", "worker", "lease", "batch"]) for _ in range(40))
    before = prefix_hits()
    done = api.chat.completions.create(model=settings.model, n=4, temperature=1.0, seed=random.randrange(1 << 30),
                                       max_tokens=12, logprobs=True,
                                       messages=[{"role": "user", "content": f"Continue: {words}"}])
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in done.choices)
    assert done.usage.completion_tokens == sum(len(c.logprobs.content) for c in done.choices)
    assert len({c.message.content for c in done.choices}) > 1, "sampled choices differ"
    full = (done.usage.prompt_tokens - 1) // settings.block_size * settings.block_size
    cached = done.usage.prompt_tokens_details.cached_tokens
    queue_helpers.wait_until(lambda: prefix_hits() - before == cached + 3 * full, 30, 0.2,
                             "the worker's prefix hits to show choices 1-3 took the prompt's blocks")


TICKET = {"type": "object", "additionalProperties": False, "required": ["title", "priority", "tags", "owner"],
          "properties": {"title": {"type": "string", "maxLength": 24},
                         "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["bug", "ui", "api", "docs"]}},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["team"],
                                   "properties": {"team": {"enum": ["core", "web", "infra"]}}}}}


def test_two_hundred_schema_lines_through_the_batches_api_all_validate(gateway, settings):
    """200 lines, four schemas (nested objects, enums, arrays, bounded integers, required fields): 200/200 valid."""
    import random

    schemas = [("Person", Person.model_json_schema(), "Describe {} and their pets as JSON."),
               ("City", CITY, "Give a city of {} as JSON."), ("Order", ORDER, "Order a drink for {} as JSON."),
               ("Ticket", TICKET, "File a ticket about {} as JSON.")]
    topics = ["Ann", "Bob", "Peru", "Japan", "login", "search", "Chile", "Eve", "billing", "Oslo"]
    lines, checks = [], {}
    for i in range(200):
        name, schema, ask = schemas[i % len(schemas)]
        body = {"messages": [{"role": "user", "content": ask.format(random.choice(topics))}],
                "response_format": schema_format(name, schema), "temperature": 0, "max_completion_tokens": 160}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body}))
        checks[f"line-{i}"] = schema
    api = sdk(gateway)
    upload = api.files.create(file=("two-hundred.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    done = queue_helpers.wait_until(
        lambda: (b := api.batches.retrieve(batch.id)).status in ("completed", "failed", "cancelled") and b,
        TIMEOUT * 4, 1.0, "the batch of 200 lines to end")
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 200, 0)
    out = [json.loads(x) for x in api.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(checks)
    for line in out:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", (line["custom_id"], choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), checks[line["custom_id"]])


def test_cancelling_a_job_with_n_choices_ends_it_cancelled_and_frees_every_choice(client, settings):
    from pagedq.config.names import Names
    from pagedq.store.connection import redis_client

    r, names = redis_client(settings.broker_url), Names.from_settings(settings)

    def engine_requests() -> int:
        return sum(int(r.hget(key, "requests") or 0) for key in r.scan_iter(names.worker_pattern))
    job = client.submit(prompt="Once upon a time", n=3, max_tokens=600, temperature=1.0, ignore_eos=True)
    queue_helpers.wait_until(lambda: engine_requests() == 3, TIMEOUT, 0.1, "the job's three choices to run")
    client.cancel(job)
    final = client.wait(job, 60)
    assert final.state == "cancelled" and final.completion_tokens < 3 * 600
    queue_helpers.wait_until(lambda: engine_requests() == 0, 30, 0.2, "every choice to leave the engine")
