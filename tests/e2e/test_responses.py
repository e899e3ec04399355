"""The Responses API end to end: the official ``openai`` SDK and the OpenAI Agents SDK against ``pagedq serve``.

One stack for the module: a real redis-server, GPU and CPU worker processes,
and a ``pagedq serve`` process with a keys file of two tenants (prefixes
``prsp:`` / ``prsp.``).  Greedy answers are compared with the same request
sent as a chat completion through the same gateway.  The last test kills the
GPU worker (kill -9) and the gateway while a background response runs: a new
gateway process answers the poll, and the job completes once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import queue_helpers
from pydantic import BaseModel, Field

from pagedq.config import Settings
from pagedq.pipeline.client import Client
from pagedq.pipeline.gateway.config import HANDOFF_VARIABLE, KEYS_FILE_VARIABLE
from pagedq.pipeline.gateway.keys import hash_key
from pagedq.pipeline.local.stack import settings_env
from pagedq.workers.processes import free_port, spawn, stop

TIMEOUT = 180
KEYS = {"sk-one": {"tenant": "one"}, "sk-two": {"tenant": "two"}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="prsp:", queue_prefix="prsp.", result_cache=False,
                    max_num_seqs=4, kv_cache_memory="256MiB", progress_interval_s=0.5,
                    worker_ttl_s=10)


class Gateway:
    """A ``pagedq serve`` process that can be killed and started again on the same port."""

    def __init__(self, settings: Settings, url: str, folder) -> None:
        self.folder, self.port = folder, free_port()
        keys = folder / "keys.json"
        keys.write_text(json.dumps({"keys": [{"sha256": hash_key(k), **v} for k, v in KEYS.items()]}))
        env = {k: v for k, v in os.environ.items() if k not in (KEYS_FILE_VARIABLE, HANDOFF_VARIABLE)}
        self.env = {**env, **settings_env(settings), "PAGEDQ_BROKER_URL": url}
        self.args = ["--port", str(self.port), "--api-keys-file", str(keys)]
        self.base = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.starts += 1
        log = self.folder / f"gateway-{self.starts}.log"
        self.proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", *self.args], log, self.env)

        def healthy() -> bool:
            assert self.proc.poll() is None, f"the gateway exited: {log.read_text()}"
            try:
                return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        queue_helpers.wait_until(healthy, 60, 0.2, "the gateway to answer /health")


@pytest.fixture(scope="module")
def gateway(settings, stack, tmp_path_factory) -> Gateway:
    gw = Gateway(settings, stack.url, tmp_path_factory.mktemp("responses"))
    gw.start()
    try:
        yield gw
    finally:
        stop(gw.proc, 30)


def sdk(gw: Gateway, key: str = "sk-one") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.base}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def poll_done(api: openai.OpenAI, response_id: str, seen: list[str] | None = None):
    def done():
        r = api.responses.retrieve(response_id)
        if seen is not None and (not seen or seen[-1] != r.status):
            seen.append(r.status)
        return r if r.status not in ("queued", "in_progress") else None
    return queue_helpers.wait_until(done, TIMEOUT, 0.1, f"response {response_id} to end")


# --- the openai SDK ---------------------------------------------------------------------------------------
def test_plain_and_streamed_match_the_chat_completion(gateway, settings):
    api = sdk(gateway)
    question = "Name three colours of the rainbow."
    plain = api.responses.create(model=settings.model, input=question, max_output_tokens=16, **GREEDY)
    chat = api.chat.completions.create(model=settings.model, messages=[{"role": "user", "content": question}],
                                       max_tokens=16, **GREEDY)
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert plain.output_text == chat.choices[0].message.content and plain.output_text
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)

    events = list(api.responses.create(model=settings.model, input=question, max_output_tokens=16, stream=True,
                                       **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    assert api.responses.retrieve(events[-1].response.id).output_text == plain.output_text


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)
    big: bool


def test_json_schema_text_format_parses(gateway, settings):
    parsed = sdk(gateway).responses.parse(model=settings.model, input="Describe Paris as JSON.", text_format=City,
                                          max_output_tokens=96, **GREEDY)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_previous_response_id_carries_the_first_turn(gateway, settings):
    api = sdk(gateway)
    first = api.responses.create(model=settings.model, input="My name is Ann. Say hello.",
                                 instructions="Answer briefly.", max_output_tokens=12, **GREEDY)
    second = api.responses.create(model=settings.model, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, **GREEDY)
    alone = api.responses.create(model=settings.model, input="What is my name?", max_output_tokens=8, **GREEDY)
    assert second.previous_response_id == first.id
    # the history is the first turn's input and output (its instructions are not carried over)
    chat = api.chat.completions.create(model=settings.model, max_tokens=8, **GREEDY, messages=[
        {"role": "user", "content": "My name is Ann. Say hello."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == chat.choices[0].message.content
    items = api.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "What is my name?")]


def test_background_polled_to_completed_and_other_tenants_get_404(gateway, settings):
    api, other = sdk(gateway), sdk(gateway, "sk-two")
    created = api.responses.create(model=settings.model, input="Write a line about rivers.", background=True,
                                   max_output_tokens=24, **GREEDY)
    assert created.status == "queued" and created.background
    seen = [created.status]
    done = poll_done(api, created.id, seen)
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens > 0
    assert seen[0] == "queued" and seen[-1] == done.status
    for call in (lambda: other.responses.retrieve(created.id), lambda: other.responses.delete(created.id),
                 lambda: other.responses.cancel(created.id), lambda: other.responses.input_items.list(created.id),
                 lambda: other.responses.create(model=settings.model, input="hi", previous_response_id=created.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert api.responses.retrieve(created.id).output_text == done.output_text  # untouched by the other tenant


def test_cancel_delete_and_refusals(gateway, settings):
    api = sdk(gateway)
    long = api.responses.create(model=settings.model, input="Count to a thousand.", background=True,
                                max_output_tokens=400, extra_body={"ignore_eos": True}, **GREEDY)
    cancelled = api.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    api.responses.delete(long.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(long.id)
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.create(model=settings.model, input=[{"type": "reasoning", "summary": []}])
    assert e.value.body["param"] == "input.0.type"
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.create(model=settings.model, input="hi", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.create(model=settings.model, input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools.0.type"
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.create(model=settings.model, input="hi", background=True, store=False)
    assert e.value.body["param"] == "background"


def test_chat_stream_continuous_usage_stats(gateway, settings):
    chunks = list(sdk(gateway).chat.completions.create(
        model=settings.model, messages=[{"role": "user", "content": "Say something."}], max_tokens=10, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == chunks[-1].usage.completion_tokens > 0
    assert len({c.usage.prompt_tokens for c in chunks}) == 1 and chunks[0].usage.prompt_tokens > 0


# --- the Agents SDK ---------------------------------------------------------------------------------------
def _agent(gateway: Gateway, settings: Settings, calls: list[str]):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key="sk-one", max_retries=0, timeout=TIMEOUT)
    model = OpenAIResponsesModel(model=settings.model, openai_client=client)
    return Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                 model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48))


def test_agents_sdk_runs_an_agent_with_a_function_tool(gateway, settings):
    from agents import Runner
    from openai.types.responses import ResponseTextDeltaEvent

    calls: list[str] = []
    result = asyncio.run(Runner.run(_agent(gateway, settings, calls), "What is the weather in Paris?",
                                    max_turns=4))
    kinds = [item.type for item in result.new_items]
    assert calls and kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output

    streamed_calls: list[str] = []

    async def streamed() -> tuple[str, list]:
        run = Runner.run_streamed(_agent(gateway, settings, streamed_calls), "What is the weather in Rome?",
                                  max_turns=4)
        deltas = [e.data.delta async for e in run.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        return run.final_output, deltas
    final, deltas = asyncio.run(streamed())
    assert streamed_calls and isinstance(final, str) and final and "".join(deltas) == final


# --- a GPU worker and the gateway killed while a background response runs ------------------------------------
def test_background_response_survives_kill_9_of_the_gpu_worker_and_a_gateway_restart(gateway, settings, stack):
    with Client(settings, stack.url) as client:
        counter = queue_helpers.DoneCounter(client.r, client.names)
        created = sdk(gateway).responses.create(model=settings.model, input="Tell a long story about a lighthouse.",
                                                background=True, max_output_tokens=160,
                                                extra_body={"ignore_eos": True}, **GREEDY)
        job = client.r.hget(client.names.response(created.id), "job_id")  # not public: read from its hash
        queue_helpers.wait_until(lambda: int(client.status(job).completion_tokens or 0) > 0, TIMEOUT,
                                 what="the response's job to run")
        gpu = next(c for c in stack.children if c.role == "gpu")
        gpu.proc.send_signal(signal.SIGKILL)
        gateway.proc.send_signal(signal.SIGKILL)
        gpu.proc.wait()
        gateway.proc.wait()
        stack.children.remove(gpu)
        assert client.status(job).state == "in_progress", "the kill came too late to matter"
        stack.add_worker("gpu")
        gateway.start()  # a new gateway process on the same port
        done = poll_done(sdk(gateway), created.id)
        assert done.status == "incomplete" and done.usage.output_tokens == 160  # ignore_eos: cut by the limit
        assert done.incomplete_details.reason == "max_output_tokens"
        assert client.status(job).attempts == 2
        queue_helpers.wait_until(lambda: counter.counts[job] >= 1, 30, what="the job's publication")
        time.sleep(1)
        counter.stop()
        assert counter.counts[job] == 1, "published twice"
