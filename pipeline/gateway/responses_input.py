"""The Responses API's request, translated to a chat completion job, and its output read back from the job.

A ``POST /v1/responses`` body is checked here for the Responses fields
(``ResponsesRequest``), then turned into a chat completion body
(``chat_body``) that the one request schema validates as any chat request
would: the same limits, constraints, tools and priorities.  Nothing about
responses reaches the workers.

- ``input`` (a string, or items: messages with text parts, ``function_call``
  and ``function_call_output``) and the items of the ``previous_response_id``
  chain become ``messages``; ``instructions`` the first, system message
  (instructions are not carried to the next response, as in OpenAI's API);
- ``max_output_tokens`` is ``max_tokens``; ``text.format`` is
  ``response_format``; ``tools`` (flat function tools) and ``tool_choice``
  (``{"type": "function", "name"}``) take chat's nested spelling.

``output_items`` turns the completed job's chat completion object into the
Responses output: one ``message`` item (its text as ``output_text``) and one
``function_call`` item per tool call.  Item ids derive from the job id, so
every gateway process builds the same object.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedq.config.messages import RequestError
from pagedq.pipeline.protocol import validation_to_request_error
from pagedq.pipeline.tools import NAME_PATTERN

ITEM_TYPES = ("message", "function_call", "function_call_output")
MAX_ITEMS = 4096


class ContentPart(BaseModel):
    """A text part of a message: ``input_text`` (user, system), ``output_text`` / ``refusal`` (assistant)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list | None = None  # sent back by SDKs with earlier output; ignored
    logprobs: list | None = None

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.value for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.value for p in self.output)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_MODELS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                            "function_call_output": FunctionCallOutputItem}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` (``name``, ``schema``, ...) flattened."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's fields that pagedq honours, those it accepts and ignores, and pagedq's
    ``priority``.  Sampling values are checked by the chat schema they are translated to."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop history: refused
    include: list[str] | None = None  # extra output (logprobs, encrypted reasoning): none is produced
    reasoning: None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    priority: int | None = None  # pagedq's: 0-9, 9 most urgent; seed, top_k, ignore_eos as in chat
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool | None = None
    timeout_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # pagedq's: not started -> expired

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, list) and len(v) > MAX_ITEMS:
            raise ValueError(f"at most {MAX_ITEMS} items")
        return v



def parse_responses_request(body: dict) -> tuple[ResponsesRequest, list[Item]]:
    """The request and its input as items; RequestError naming the field otherwise."""
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise RequestError(f"tools.{i}.type: only function tools are supported, not {tool.get('type')!r}",
                               f"tools.{i}.type")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise validation_to_request_error(e) from None
    if req.background and not req.store:
        raise RequestError("background: a background response must be stored (store: true)", "background")
    return req, parse_items(req.input)


def parse_items(raw: str | list[dict[str, Any]], field: str = "input") -> list[Item]:
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[Item] = []
    for i, item in enumerate(raw):
        kind = item.get("type") or "message"
        if not isinstance(kind, str) or kind not in _ITEM_MODELS:
            raise RequestError(f"{field}.{i}.type: items of type {kind!r} are not supported; "
                               f"only {', '.join(ITEM_TYPES)}", f"{field}.{i}.type")
        try:
            items.append(_ITEM_MODELS[kind].model_validate(item))
        except ValidationError as e:
            err = validation_to_request_error(e)
            raise RequestError(f"{field}.{i}.{err}", f"{field}.{i}.{err.param}" if err.param else field) from None
    return items


def stored_items(items: list[Item]) -> list[dict]:
    """The items as ``input_items`` lists them: each with an id, messages with typed parts."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        d["id"] = item.id or _new_id(item.type)
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            parts = [{"type": kind, "text": item.content}] if isinstance(item.content, str) else d["content"]
            d["content"] = parts
            d.setdefault("status", "completed")
        out.append(d)
    return out


def _new_id(kind: str) -> str:
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
    return f"{prefix}_{uuid.uuid4().hex}"


# --- to chat ----------------------------------------------------------------------------------------------
def to_messages(instructions: str | None, items: list[Item]) -> list[dict]:
    """Chat messages: the instructions as the system message, function calls as assistant ``tool_calls``
    (consecutive calls, and a text answer right before them, in one message), their outputs as tool messages."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def chat_body(req: ResponsesRequest, items: list[Item], default_priority: int) -> dict:
    """The chat completion body the response runs as."""
    body: dict[str, Any] = {"model": req.model, "messages": to_messages(req.instructions, items),
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                            "stream": req.stream or None, "seed": req.seed, "top_k": req.top_k,
                            "ignore_eos": req.ignore_eos,
                            "priority": req.priority if req.priority is not None else default_priority}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.json_schema, "description": fmt.description,
                "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                                          if v is not None}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return {k: v for k, v in body.items() if v is not None}


_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def responses_param(param: str | None) -> str | None:
    """A chat field named by the schema, as the Responses request spells it."""
    if not param:
        return param
    head, _, rest = param.partition(".")
    if head == "messages":
        return "input"
    if head == "tools" and ".function." in param:
        return param.replace(".function.", ".")
    return _PARAMS.get(head, head) + ("." + rest if rest and head in _PARAMS else "")


def as_responses_error(e: RequestError) -> RequestError:
    param = responses_param(e.param)
    if param == e.param:
        return e
    message = str(e)
    if e.param and message.startswith(e.param + ":"):
        message = param + message[len(e.param):]
    return RequestError(message, param, code=e.code)


# --- from the job's chat completion -----------------------------------------------------------------------
def output_items(job_id: str, result: dict) -> list[dict]:
    """The Responses output of a completed job: its text as a message item, then its function calls."""
    message = result["choices"][0].get("message", {})
    items: list[dict] = []
    text = message.get("content")
    if text:
        items.append(message_item(job_id, text))
    for i, call in enumerate(message.get("tool_calls") or []):
        items.append(call_item(job_id, i, call))
    return items


def message_item(job_id: str, text: str, status: str = "completed") -> dict:
    content = [output_text(text)] if status == "completed" else []
    return {"id": f"msg_{job_id}", "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(job_id: str, index: int, call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"id": f"fc_{job_id}_{index}", "type": "function_call", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def usage_of(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
