"""Engine output to OpenAI-shaped completion objects and Batch output lines."""

from __future__ import annotations

import itertools
import uuid

from pagedq.config.messages import ChoiceOutput, Completion, PromptScores
from pagedq.pipeline.tools import parse_tool_calls
from pagedq.store.result_cache import ResultCache

__all__ = ["Completion", "batch_output_line", "build_response", "cache_answer"]


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _chat_logprobs(tokenizer, items: list[dict]) -> dict:
    content = []
    for item in items:
        tid, lp = item["token"]
        tok = _token_str(tokenizer, tid)
        top = [{"token": _token_str(tokenizer, t), "logprob": v, "bytes": list(_token_str(tokenizer, t).encode())}
               for t, v in item["top"]]
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top})
    return {"content": content}


def _text_logprobs(tokenizer, items: list[dict]) -> dict:
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for item in items:
        tid, lp = item["token"]
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        lps.append(lp)
        tops.append({_token_str(tokenizer, t): v for t, v in item["top"]})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _choice(c: Completion, index: int, out: Completion | ChoiceOutput, tokenizer) -> dict:
    logprobs = None
    if c.want_logprobs is not None:
        logprobs = (_chat_logprobs if c.kind == "chat" else _text_logprobs)(tokenizer, out.logprobs)
    choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason}
    if c.kind != "chat":
        choice["text"] = out.text
        if c.prompt is not None:
            _with_prompt(choice, c.prompt, c.want_logprobs, _TokenStrings(tokenizer))
        return choice
    choice["message"] = {"role": "assistant", "content": out.text}
    if c.tool_parsing:
        content, calls = parse_tool_calls(out.text, c.tool_parsing)
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            if out.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
    return choice


class _TokenStrings(dict):
    """Token id -> its text, each decoded once (a scored prompt repeats its tokens among the top ones)."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = _token_str(self.tokenizer, token_id)
        return text


def _with_prompt(choice: dict, prompt: PromptScores, want_logprobs: int | None, strings: _TokenStrings) -> None:
    """The prompt before the answer (``echo``: its text, and its tokens' logprobs when ``logprobs`` is asked,
    the first token's None as OpenAI's), and vLLM's ``prompt_logprobs`` list when asked."""
    scored = prompt.logprobs[1:] if prompt.logprobs is not None else []
    if prompt.echo:
        text = strings.tokenizer.decode(prompt.token_ids)
        choice["text"] = text + choice["text"]
        answer = choice["logprobs"]
        if answer is not None:
            tokens = [strings[t] for t in prompt.token_ids]
            offsets = list(itertools.accumulate([len(t) for t in tokens[:-1]], initial=0))
            choice["logprobs"] = {
                "tokens": tokens + answer["tokens"],
                "token_logprobs": [None] + [e["token"][1] for e in scored] + answer["token_logprobs"],
                "top_logprobs": [None] + [{strings[t]: v for t, v in e["top"][:want_logprobs]} for e in scored]
                + answer["top_logprobs"],
                "text_offset": offsets + [o + len(text) for o in answer["text_offset"]]}
    if prompt.num_top is not None:
        choice["prompt_logprobs"] = [None] + [_vllm_prompt_position(e, prompt.num_top, strings) for e in scored]


def _vllm_prompt_position(entry: dict, num_top: int, strings: _TokenStrings) -> dict:
    """One position of vLLM's ``prompt_logprobs``: token id (a string) -> logprob, rank, decoded token; the
    prompt's own token first, then the ``num_top`` most likely."""
    token, logprob, rank = entry["token"]
    position = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": strings[token]}}
    for r, (t, v) in enumerate(entry["top"][:num_top], start=1):
        position.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": strings[t]})
    return position


def build_response(c: Completion, tokenizer) -> dict:
    """The chat.completion or text_completion object for a finished request: one choice per answer (``n``).

    The text was detokenized by the GPU worker (and cut at a stop string there); the tokenizer
    only renders logprobs' tokens."""
    answers: list[Completion | ChoiceOutput] = [c, *c.others]
    completion_tokens = sum(len(a.output_token_ids) for a in answers)
    obj, prefix = ("chat.completion", "chatcmpl-") if c.kind == "chat" else ("text_completion", "cmpl-")
    return {
        "id": prefix + c.request_id,
        "object": obj,
        "created": c.created,
        "model": c.model,
        "choices": [_choice(c, i, a, tokenizer) for i, a in enumerate(answers)],
        "usage": {"prompt_tokens": c.num_prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": c.num_prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": c.num_cached_tokens}},
    }


def cache_answer(cache: ResultCache, c: Completion, body: dict) -> bool:
    """File a published answer in the result cache, if its request is cacheable (the producer recorded its
    digest) and ended on its own, under the fingerprint of the weights that produced it, and only while the
    model is still served with those weights (``store/result_cache.py``)."""
    if any(a.finish_reason not in ("stop", "length") for a in [c, *c.others]):
        return False
    request, version = cache.r.hmget(cache.names.job(c.request_id), "cache_request", "cache_version")
    if not request:
        return False
    return cache.put_answer(c.model, int(version or 0), c.fingerprint, request, body)


# HTTP status of an error line, by error code (everything else is the request's fault: 400).
STATUS_OF_CODE = {"queue_full": 429, "server_error": 500, "engine_error": 500, "poison": 500}


def batch_output_line(custom_id: str | None, body: dict | None = None, error: Exception | None = None) -> dict:
    """An OpenAI Batch output line: a 200 response with ``body``, or an error (status by its code)."""
    request_id = f"req_{uuid.uuid4().hex}"
    if error is None:
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
    code = getattr(error, "code", "invalid_request_error")
    status = STATUS_OF_CODE.get(code, 400)
    detail = {"message": str(error), "type": "invalid_request_error" if status == 400 else code,
              "param": getattr(error, "param", None), "code": code}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": {"error": detail}},
            "error": {"code": detail["code"], "message": detail["message"]}}
