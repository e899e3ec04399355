"""The request schema (OpenAI-compatible): the one definition of a valid request.

Every path in (``Client.submit``, batches, the CPU worker re-reading a
message) validates with these models, so nothing accepted at the edge is
refused later.  A bad request raises ``RequestError`` naming the field.
``to_sampling_params`` maps a valid request onto the engine's
``SamplingParams``; every value it passes is one the engine can use (seeds
fit a 64-bit generator, floats are finite, strings are valid Unicode).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pagedq.config.messages import RequestError, check_context
from pagedq.config.sampling_params import SamplingParams
from pagedq.pipeline.structured_outputs import (
    BOTH_SPELLINGS,
    ResponseFormat,
    StructuredOutputs,
    check_constraint,
    constraint_of,
    move_guided_aliases,
)
from pagedq.pipeline.tools import (
    ToolCall,
    ToolChoice,
    Tools,
    check_tool_choice,
    tool_constraint,
    tool_parsing,
)

__all__ = ["RequestError", "check_context"]  # re-exported: defined with the other wire contracts

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT_MAX_TOKENS = 256


MAX_INT = 2**31 - 1  # token ids, counts: what a tensor index holds
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes
MAX_CHOICES = 128  # n, as OpenAI bounds it
MAX_CACHE_SALT = 256  # characters of a request's cache_salt
# Bounds on what one request may cost (issue 48), each refused with a 400 naming its field:
MAX_STOP_TOKEN_IDS = 64  # checked against each generated token of each sequence
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it; added to every step's logits
# n x max_tokens x (1 + top logprobs): the tokens and logprob entries one answer may hold.  n 128 with 4,096
# tokens each fits, or 20 top logprobs on 24,966 tokens (a result of ~25 MB of JSON at most).
MAX_OUTPUT_BUDGET = 1 << 19
# A regex (a constraint, or a JSON schema's ``pattern``) compiles to an automaton about as large as the pattern
# with its counted repeats unrolled (``a{1000}`` is a thousand states; ``(a{100}){100}`` ten thousand): bounded.
MAX_REGEX_EXPANSION = 4096


def _valid_unicode(text: str) -> str:
    """Refuse lone UTF-16 surrogates: they cannot be encoded as UTF-8, so no tokenizer or JSON peer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate {text[e.start]!r} at position {e.start}: "
                         "not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]


class TextPart(BaseModel):
    """One part of a message's ``content`` list; only text parts are supported."""

    model_config = ConfigDict(extra="forbid")
    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"content parts of type {v!r} are not supported; only 'text'")
        return v


class ChatMessage(BaseModel):
    """A message; ``developer`` is rendered as ``system`` unless the chat template knows it (``preprocess``).
    ``tool_calls`` (assistant) and ``tool_call_id`` (tool) carry a tool-call round trip (``pipeline/tools.py``);
    an assistant message with tool calls may leave ``content`` out or null."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_optional_beside_tool_calls(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("tool_calls") \
                and "content" not in data:
            data = {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: required in a tool message, and only there")
        return self

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them); "" for null."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)


# Fields that official SDKs send and that do not change the answer: accepted, never used, never stored in
# the job's message nor in the result cache's key (``exclude``).
def _ignored():
    return Field(default=None, exclude=True)


def _check_constraint(constraint: list[str], info: ValidationInfo) -> None:
    if info.data.get("ignore_eos"):
        raise ValueError("cannot be combined with ignore_eos: the grammar ends the output with an "
                         "end-of-sequence token")
    _check_regexes(constraint)
    check_constraint(constraint)


def _check_regexes(constraint: list[str]) -> None:
    """Refuse a regex constraint, or a JSON schema ``pattern``, whose unrolled size is over MAX_REGEX_EXPANSION
    (before anything compiles it: at the edge, and on the GPU worker)."""
    kind, text = constraint[:2]
    if kind == "regex":
        patterns = [text]
    elif kind == "json_schema":
        patterns, stack = [], [json.loads(text)]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("pattern"), str):
                    patterns.append(node["pattern"])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    else:
        return
    for pattern in patterns:
        size = regex_expansion(pattern)
        if size > MAX_REGEX_EXPANSION:
            raise ValueError(f"the regex {pattern[:40]!r} unrolls its counted repeats to {size:,} items; at most "
                             f"{MAX_REGEX_EXPANSION:,}")


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def regex_expansion(pattern: str) -> int:
    """About how many items ``pattern`` holds with every counted repeat (``{m}``, ``{m,n}``) unrolled: each atom
    counts 1, times the repeat that follows it, groups nested multiplying.  ``*``, ``+``, ``?`` and ``{m,}``
    are loops (counted ``m`` or 1).  Capped just above MAX_REGEX_EXPANSION."""
    cap = MAX_REGEX_EXPANSION + 1
    stack, total, i = [0], 0, 0  # stack: the size of each open group so far
    while i < len(pattern):
        c, atom = pattern[i], 1
        if c == "\\":
            i += 2
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            stack.append(0)
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            atom = stack.pop()
            i += 1
        elif c in "|^$":
            i += 1
            continue
        else:
            i += 1
        match = _COUNTED.match(pattern, i)
        if match:
            low, high = int(match[1]), match[2]
            atom *= max(low, int(high)) if high else max(low, 1)
            i = match.end()
        stack[-1] = min(stack[-1] + atom, cap)
    for size in reversed(stack):  # groups never closed: their items count once
        total = min(total + size, cap)
    return total


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that starts at ``pattern[i]`` (``[``)."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


class SamplingFields(BaseModel):
    """Fields shared by chat and text requests (OpenAI names, plus vLLM's extras)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0  # below 1e-5: greedy
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(le=MAX_INT)] = -1  # above the vocabulary size: off, as vLLM clamps it
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] = 1.0
    ignore_eos: bool = False
    # OpenAI's: token id (a decimal string) -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # answers to the one prompt, computed once
    stream: bool = False
    user: Text | None = None
    priority: Annotated[int, Field(ge=0, le=9)] = 5
    use_result_cache: bool = True  # opt out of the result cache
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's; guided_* fields are moved here
    store: bool | None = _ignored()
    metadata: dict[str, Text] | None = _ignored()
    service_tier: Text | None = _ignored()
    prompt_cache_key: Text | None = _ignored()
    safety_identifier: Text | None = _ignored()
    # vLLM's: requests with different salts share no cached answer nor prompt block.  Behind the gateway it is
    # always set: to the tenant's cache scope hashed with the request's own salt (``scoped_cache_salt``).
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _guided_aliases(cls, data: Any) -> Any:
        return move_guided_aliases(data)

    @field_validator("response_format")
    @classmethod
    def _response_format_compiles(cls, v: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        constraint = constraint_of(v, None)
        if constraint is not None:
            _check_constraint(constraint, info)
        return v

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _one_spelling(cls, v: Any) -> Any:
        if v is BOTH_SPELLINGS:
            raise ValueError("give structured_outputs or the guided_* fields, not both")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs_compile(cls, v, info: ValidationInfo):
        if v is None:
            return v
        fmt = info.data.get("response_format")
        if fmt is not None and fmt.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        if isinstance(v.get("json"), str):
            try:
                json.loads(v["json"])
            except (json.JSONDecodeError, RecursionError):
                raise ValueError("json: not valid JSON") from None
        _check_constraint(constraint_of(None, v), info)
        return v

    @property
    def constraint(self) -> list[str] | None:
        """``[kind, text]`` (``pagedq.config.constraints``) the output must follow, or None."""
        return constraint_of(self.response_format, self.structured_outputs)

    @staticmethod
    def constraint_given(data: dict) -> bool:
        """Whether validated fields ``data`` ask for a structured output."""
        return constraint_of(data.get("response_format"), data.get("structured_outputs")) is not None

    @field_validator("stream")
    @classmethod
    def _one_choice_streamed(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("n", 1) > 1:
            raise ValueError("cannot be combined with n > 1 yet; leave stream out or ask for one choice")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, not {len(v)}")
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_INT):
                raise ValueError(f"keys must be token ids (non-negative integers), not {key[:20]!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 16 or any(not s for s in stops)):
            raise ValueError("stop takes at most 16 non-empty strings")
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # OpenAI's newer name for max_tokens; copied into max_tokens (which wins when both are given).
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = Field(default=None, exclude=True)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a required choice makes one call

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _max_completion_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_fits_tools(cls, v: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        check_tool_choice(info.data.get("tools"), v)
        constraint = tool_constraint(info.data.get("tools") or [], tool_parsing(info.data.get("tools"), v), True)
        if constraint is not None:
            if cls.constraint_given(info.data):
                raise ValueError("a required or named tool choice cannot be combined with response_format or "
                                 "structured_outputs")
            _check_constraint(constraint, info)
        return v

    @property
    def tool_parsing(self) -> str:
        """How the answer becomes tool calls (``pipeline/tools.py``); "" when it does not."""
        return tool_parsing(self.tools, self.tool_choice)

    @property
    def constraint(self) -> list[str] | None:
        parsing = self.tool_parsing
        tool = tool_constraint(self.tools or [], parsing, self.parallel_tool_calls is not False)
        return tool if tool is not None else super().constraint

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # the answer starts with the prompt; with ``logprobs``, the prompt's tokens are scored too
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # vLLM's: top-N beside each prompt token's
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] | None = None  # 0: score the prompt, generate nothing

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """OpenAI's list of prompts, of one prompt (what lm-eval sends): that prompt."""
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > 1:
                raise ValueError(f"one prompt per request: a list of {len(v)} prompts is not supported yet; "
                                 "send them one at a time (or as batch lines)")
            return v[0]
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


AnyRequest = ChatCompletionRequest | CompletionRequest


def to_sampling_params(req: AnyRequest) -> SamplingParams:
    return SamplingParams(
        n=req.n, max_tokens=max_tokens_of(req), temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, stop=req.stop or [],
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=req.num_logprobs,
        constraint=req.constraint, logit_bias={int(k): b for k, b in (req.logit_bias or {}).items()},
        cache_salt=req.cache_salt or "", echo=getattr(req, "echo", False),
        prompt_logprobs=getattr(req, "prompt_logprobs", None))


def max_tokens_of(req: AnyRequest) -> int:
    """The request's ``max_tokens``, DEFAULT_MAX_TOKENS when left out (0 is a prompt scored, not a default)."""
    return DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def scoped_cache_salt(scope: str, salt: Any) -> Any:
    """The ``cache_salt`` a request of cache scope ``scope`` (a tenant, or the cache group its keys share) runs
    with: the scope and the request's own salt hashed together, so no request of another scope, whatever salt
    it sends, shares its cached answers or prompt blocks.  A salt the schema refuses is returned as it is, for
    the schema to name."""
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= MAX_CACHE_SALT and _is_unicode(salt)):
        return salt
    return hashlib.sha256(f"{scope}\n{salt or ''}".encode()).hexdigest()


def request_body(req: AnyRequest) -> dict:
    """The request as its job's message carries it and the result cache keys it: JSON values, no nulls, and
    none of the fields that are accepted but ignored (``exclude``); ``guided_*`` already moved into
    ``structured_outputs``, ``max_completion_tokens`` into ``max_tokens``."""
    return req.model_dump(mode="json", exclude_none=True)


def cache_body(req: AnyRequest) -> dict:
    """What the result cache's key hashes (``request_digest`` sorts its keys): the request body, plus the
    constraint as text, where the order of a schema's properties (the order of the answer's) survives."""
    body = request_body(req)
    if req.constraint is not None:
        body["constraint"] = req.constraint
    return body


def parse_request(url: str, body: Any) -> AnyRequest:
    """Validate a request body for an endpoint; raises RequestError naming the problem."""
    kinds = {CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest}
    if url not in kinds:
        raise RequestError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, not {url!r}", "url")
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object", "body")
    try:
        req = kinds[url].model_validate(body)
    except ValidationError as e:
        raise validation_to_request_error(e) from None
    check_output_budget(req)
    check_scoring(req)
    return req


def check_scoring(req: AnyRequest) -> None:
    """Refuse ``max_tokens: 0`` unless the prompt is scored (``echo``, ``prompt_logprobs``), and scoring a
    streamed answer (not supported yet)."""
    if not isinstance(req, CompletionRequest):
        return
    scored = req.echo or req.prompt_logprobs is not None
    if req.max_tokens == 0 and not scored:
        raise RequestError("max_tokens: 0 only with echo or prompt_logprobs (a prompt scored, nothing generated)",
                           "max_tokens")
    if scored and req.stream:
        field = "echo" if req.echo else "prompt_logprobs"
        raise RequestError(f"{field}: cannot be combined with stream yet", field)


def check_output_budget(req: AnyRequest) -> None:
    """Refuse a request whose answer could hold more than MAX_OUTPUT_BUDGET tokens and logprob entries.

    One plain sequence (n 1, no logprobs) is bounded by the model's context instead, so a too-large max_tokens
    there is the model check's ``context_length_exceeded``, as OpenAI answers it."""
    max_tokens = max_tokens_of(req)
    per_token = 1 + (req.num_logprobs or 0)
    cost = req.n * max_tokens * per_token
    if cost > MAX_OUTPUT_BUDGET and req.n * per_token > 1:
        raise RequestError(f"max_tokens: n x max_tokens x (1 + top logprobs) = {req.n} x {max_tokens} x "
                           f"{per_token} = {cost:,} is over the budget of {MAX_OUTPUT_BUDGET:,} per request; ask "
                           "for fewer tokens, choices or logprobs", "max_tokens")


# OpenAI fields that would change the answer and that pagedq does not implement yet: a 400 naming them.
NOT_SUPPORTED_YET = {"functions", "function_call", "prompt_logprobs",
                     "best_of", "audio", "modalities", "prediction", "reasoning_effort", "verbosity",
                     "web_search_options"}


def _is_union_tag(part: str) -> bool:
    """A location part naming which alternative of a union was tried (``str``, ``list[int]``...), not a field."""
    return part in ("str", "int", "float", "bool") or part.startswith(("function-", "list[", "dict[", "literal["))


def validation_to_request_error(e: ValidationError) -> RequestError:
    errors = e.errors()
    # Of a union's alternatives, report the one whose type fit (its value was wrong), if any.
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    field = ".".join(str(p) for p in err["loc"] if not _is_union_tag(str(p)))
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden" and field in NOT_SUPPORTED_YET:
        message = "not supported yet"
    return RequestError(f"{field or 'request'}: {message}", field or None)


class BatchLine(BaseModel):
    """One line of an OpenAI Batch input file."""

    model_config = ConfigDict(extra="forbid")
    custom_id: Annotated[Text, Field(min_length=1)]
    method: Literal["POST"] = "POST"
    url: str
    body: dict


def _is_unicode(text: str) -> bool:
    try:
        _valid_unicode(text)
        return True
    except ValueError:
        return False


def read_batch_file(path) -> list[str]:
    """A batch file's non-blank lines.  Bytes that are not UTF-8 survive as lone surrogates
    (``surrogateescape``), so the schema refuses just their line, naming the field."""
    with open(path, "rb") as f:
        raw = f.read()
    return split_lines(raw)


def split_lines(raw: bytes) -> list[str]:
    """Non-blank JSONL lines: split on newlines only (JSON strings may hold U+2028 and other line breaks)."""
    text = raw.decode("utf-8", "surrogateescape")
    return [ln.removesuffix("\r") for ln in text.split("\n") if ln.strip()]


def parse_batch_line(line: str) -> tuple[str | None, AnyRequest, str]:
    """(custom_id, request, url); raises RequestError. The custom_id is recovered when it can be."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise RequestError(f"line is not valid JSON: {e.msg} at column {e.colno}", "line") from None
    except RecursionError:
        raise RequestError("line is nested too deeply", "line") from None
    custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
    try:
        item = BatchLine.model_validate(raw)
    except ValidationError as e:
        err = validation_to_request_error(e)
        err.custom_id = custom_id if isinstance(custom_id, str) and _is_unicode(custom_id) else None
        raise err from None
    try:
        return item.custom_id, parse_request(item.url, item.body), item.url
    except RequestError as err:
        err.custom_id = item.custom_id
        raise
