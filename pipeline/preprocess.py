"""Requests to token ids: the chat template and tokenization (the context check is ``check_context``)."""

from __future__ import annotations

from pagedq.pipeline.protocol import AnyRequest, ChatCompletionRequest


def chat_messages(req: ChatCompletionRequest, template: str | None) -> list[dict]:
    """The messages as chat templates read them: content as one string; ``developer`` becomes ``system``
    unless the template mentions it (what vLLM does); ``name`` only when given."""
    knows_developer = "developer" in str(template or "")
    messages = []
    for m in req.messages:
        role = "system" if m.role == "developer" and not knows_developer else m.role
        message = {"role": role, "content": m.text}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages


def render_prompt(tokenizer, req: AnyRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req, tokenizer.chat_template)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(req.prompt, list):
        return list(req.prompt)
    return tokenizer(req.prompt)["input_ids"]
