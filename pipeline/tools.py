"""Tools (function calling): the request's fields, the prompt they add, the constraint they set, the calls found.

``tools`` declares functions (``{"type": "function", "function": {"name",
"description"?, "parameters"?, "strict"?}}``); ``tool_choice`` says what the
answer may be:

- ``"none"``: text; the tools are not put in the prompt.
- ``"auto"`` (the default when tools are given): text, tool calls, or both;
  the model writes each call as a Hermes block (below), and the blocks that
  parse become the answer's ``tool_calls``.
- ``"required"``: constrained (``tool_constraint``) to a JSON array of one
  or more ``{"name", "arguments"}`` calls of declared functions, arguments
  by each function's ``parameters`` schema (one call when
  ``parallel_tool_calls`` is false).
- ``{"type": "function", "function": {"name": N}}``: constrained to the
  arguments of N, by its ``parameters`` schema.

Chat templates that render tools (their source mentions ``tools``: Llama 3,
Qwen2, Hermes) get them through ``apply_chat_template(tools=...)``, with
``tool`` messages and assistant ``tool_calls`` as they expect them.  For
templates without tools (SmolLM2's) pagedq writes the Hermes format itself:
``tools_system_prompt`` in the system message, each earlier call as a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in its assistant message, and each tool result as a user message
``<tool_response>...</tool_response>``.

``tool_parsing`` (a short string on the job's messages) tells the result
consumer how the answer's text becomes ``tool_calls``: ``""`` (it does not),
``"auto"``, ``"required"`` or ``"function:<name>"``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedq.config.constraints import canonical_json

MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,64}$"  # a function's name, declared or called
_NAME = re.compile(NAME_PATTERN)
_SEPARATOR = re.compile(r"\s*,?\s*")
_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*"([a-zA-Z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(.*)$', re.DOTALL)
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls follow the schema whenever they are constrained; otherwise as written

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ToolSpec], Field(min_length=1, max_length=MAX_TOOLS)]


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An earlier call in the history (an assistant message's ``tool_calls``)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    @property
    def arguments(self) -> Any:
        """The arguments as a value (templates render them as JSON); text that is not JSON stays text."""
        ok, value = _loads(self.function.arguments)
        return value if ok else self.function.arguments


def tool_parsing(tools: list[ToolSpec] | None, choice: ToolChoice | None) -> str:
    """How the answer becomes tool calls (the module's docstring); ``""`` without tools or with ``"none"``."""
    if not tools or choice == "none":
        return ""
    if isinstance(choice, NamedToolChoice):
        return "function:" + choice.function.name
    return choice or "auto"


def check_tool_choice(tools: list[ToolSpec] | None, choice: ToolChoice | None) -> None:
    """Raise ValueError unless ``choice`` fits ``tools`` (the caller names ``tool_choice``)."""
    if choice is None or choice == "none":
        return
    if not tools:
        raise ValueError("needs tools")
    names = [t.function.name for t in tools]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"names the function {choice.function.name!r}, which tools does not declare "
                         f"(declared: {', '.join(names)})")


def tool_constraint(tools: list[ToolSpec], parsing: str, parallel: bool) -> list[str] | None:
    """The ``["json_schema", text]`` constraint of a required or named choice, or None."""
    if parsing.startswith("function:"):
        name = parsing.removeprefix("function:")
        spec = next(t.function for t in tools if t.function.name == name)
        return ["json_schema", canonical_json(spec.schema)]
    if parsing != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": t.function.schema},
              "required": ["name", "arguments"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return ["json_schema", canonical_json(schema)]


# --- the prompt ------------------------------------------------------------------------------------------
def template_renders_tools(template: str | None) -> bool:
    return "tools" in str(template or "")


def tools_system_prompt(tools: list[ToolSpec]) -> str:
    """The tools in the Hermes format, for templates without tools of their own."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer the user. The functions are declared in "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments in <tool_call></tool_call>:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')


def call_block(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


# --- the answer ------------------------------------------------------------------------------------------
def _loads(text: str) -> tuple[bool, Any]:
    """(parsed, value): model output may be any text, nested past the parser's limit too."""
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def _call(name: str, arguments: Any) -> dict:
    # ASCII escapes: a lone surrogate the model wrote as an escape stays one (UTF-8 would refuse it)
    if isinstance(arguments, str):  # written as a string of JSON: kept, any lone surrogate as its escape
        text = arguments.encode("utf-8", "backslashreplace").decode("utf-8")
    else:
        text = json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def _named_call(item: Any) -> dict | None:
    if isinstance(item, dict) and isinstance(item.get("name"), str) and _NAME.match(item["name"]) \
            and "arguments" in item:
        return _call(item["name"], item["arguments"])
    return None


def _cut_calls(text: str) -> list[dict]:
    """The calls of a required answer cut short: ``[{"name": N, "arguments": A}, ...`` read call by call, the
    last one's arguments kept as text."""
    calls, pos, decoder = [], 1, json.JSONDecoder()
    if not text.startswith("["):
        return []
    while True:
        try:
            item, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            break
        call = _named_call(item)
        if call is not None:
            calls.append(call)
        pos = _SEPARATOR.match(text, pos).end()
    cut = _CUT_CALL.match(text, pos)
    if cut is not None:
        calls.append(_call(cut.group(1), cut.group(2)))
    return calls


def parse_tool_calls(text: str, parsing: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer; content None when the answer is only calls.

    A required or named choice always yields calls: its grammar makes the text a prefix of the calls' JSON,
    so an answer cut by max_tokens (``finish_reason: "length"``, as OpenAI answers) keeps every whole call
    and the cut one with its arguments as far as they were written (not valid JSON then).  Only a required
    answer cut inside the first function's name has no call.  Under ``auto``, text that does not parse is
    content with no calls."""
    if parsing.startswith("function:"):
        ok, arguments = _loads(text)
        return None, [_call(parsing.removeprefix("function:"), arguments if ok else text)]
    if parsing == "required":
        ok, items = _loads(text)
        calls = [c for c in map(_named_call, items if ok and isinstance(items, list) else []) if c is not None]
        calls = calls or _cut_calls(text)
        return (None, calls) if calls else (text, [])
    if parsing != "auto" or "<tool_call>" not in text:
        return text, []
    calls = []
    for block in _CALL_BLOCK.findall(text):
        ok, item = _loads(block)
        call = _named_call(item) if ok else None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls
