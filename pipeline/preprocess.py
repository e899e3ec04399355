"""Requests to token ids: the chat template and tokenization (the context check is ``check_context``)."""

from __future__ import annotations

from pagedq.pipeline.protocol import AnyRequest, ChatCompletionRequest


def render_prompt(tokenizer, req: AnyRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump() for m in req.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(req.prompt, list):
        return list(req.prompt)
    return tokenizer(req.prompt)["input_ids"]
