"""Shared helpers for engine tests: a small-footprint Settings, ShareGPT prompts, HF references."""

from __future__ import annotations

import functools

import torch

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM


def settings(**overrides) -> Settings:
    base = dict(kv_cache_memory="256MiB", max_num_seqs=64, max_num_batched_tokens=512)
    base.update(overrides)
    return Settings(**base)


@functools.lru_cache(maxsize=4)
def engine(**overrides) -> LLM:
    return LLM(settings(**overrides))


def fresh_engine(**overrides) -> LLM:
    return LLM(settings(**overrides))


NUM_PROMPTS = 20  # ShareGPT prompts the parity tests run (HF's reference costs ~4 s each here)


@functools.lru_cache(maxsize=1)
def sharegpt_prompts(num: int = NUM_PROMPTS, max_prompt_len: int = 200) -> list[list[int]]:
    from sharegpt import sample_requests

    tok = engine().tokenizer
    return [r.prompt_token_ids for r in sample_requests(tok, num, seed=1, max_prompt_len=max_prompt_len)]


@functools.lru_cache(maxsize=1)
def hf_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine().model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run past EOS like ignore_eos, without masking it
    return model


def hf_greedy(prompt: list[int], new_tokens: int, model=None) -> list[int]:
    """Hugging Face transformers' own greedy continuation, one prompt at a time (no padding)."""
    model = model or hf_model()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)
