"""Requests to token ids: the chat template and tokenization (the context check is ``check_context``)."""

from __future__ import annotations

from jinja2 import TemplateError

from pagedq.pipeline.protocol import AnyRequest, ChatCompletionRequest, ChatMessage
from pagedq.pipeline.tools import call_block, template_renders_tools, tools_system_prompt


def _native(m: ChatMessage, role: str) -> dict:
    """A message as templates that render tools read it (tool calls' arguments as values)."""
    message: dict = {"role": role, "content": m.text}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.arguments}}
                                 for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _hermes(m: ChatMessage, role: str) -> dict:
    """A message in pagedq's tool format (``pipeline/tools.py``), for templates without tools."""
    text = m.text
    if m.tool_calls:
        blocks = [call_block(c.function.name, c.arguments) for c in m.tool_calls]
        text = "\n".join(([text] if text else []) + blocks)
    if m.role == "tool":
        role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
    message = {"role": role, "content": text}
    if m.name is not None:
        message["name"] = m.name
    return message


def chat_messages(req: ChatCompletionRequest, template: str | None) -> list[dict]:
    """The messages as chat templates read them: content as one string; ``developer`` becomes ``system``
    unless the template mentions it (what vLLM does); ``name`` only when given.  Tools (unless
    ``tool_choice`` is none) go in the system message when the template does not render them itself."""
    knows_developer = "developer" in str(template or "")
    native = template_renders_tools(template)
    shape = _native if native else _hermes
    messages = [shape(m, "system" if m.role == "developer" and not knows_developer else m.role)
                for m in req.messages]
    if req.tool_parsing and not native:
        prompt = tools_system_prompt(req.tools or [])
        if messages[0]["role"] == "system":
            messages[0]["content"] = messages[0]["content"] + "\n\n" + prompt
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def fold_system(messages: list[dict]) -> list[dict]:
    """For templates without a system role (Gemma 2's raises on one): the system text opens the first user
    message, after which a blank line, as Gemma 3's own template does with it."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    first_user = next((m for m in rest if m["role"] == "user"), None)
    if first_user is None:
        rest.insert(0, first_user := {"role": "user", "content": ""})
    first_user["content"] = "\n\n".join([*system, first_user["content"]] if first_user["content"] else system)
    return rest


def render_prompt(tokenizer, req: AnyRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req, tokenizer.chat_template)
        tools = None
        if req.tool_parsing and template_renders_tools(tokenizer.chat_template):
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except TemplateError:
            if not any(m["role"] == "system" for m in messages):
                raise
            text = tokenizer.apply_chat_template(fold_system(messages), tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(req.prompt, list):
        return list(req.prompt)
    return tokenizer(req.prompt)["input_ids"]
