"""Requests to token ids: chat template, tokenization, context-length check."""

from __future__ import annotations

from pagedq.pipeline.protocol import AnyRequest, ChatCompletionRequest, RequestError
from pagedq.workers.sampling_params import SamplingParams


def render_prompt(tokenizer, req: AnyRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump() for m in req.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(req.prompt, list):
        return list(req.prompt)
    return tokenizer(req.prompt)["input_ids"]


def check_context(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    if any(t >= vocab_size for t in prompt_ids):
        raise RequestError(f"prompt: token ids must be below the vocabulary size {vocab_size}", "prompt")
    need = len(prompt_ids) + params.max_tokens
    if need > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens; the request needs {need} "
            f"({len(prompt_ids)} in the prompt, {params.max_tokens} in max_tokens)", "max_tokens",
            code="context_length_exceeded")
