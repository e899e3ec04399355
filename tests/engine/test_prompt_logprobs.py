"""Prompt logprobs (vLLM's ``prompt_logprobs``, the completions ``echo``): computed in the prefill, equal to
Hugging Face transformers' ``log_softmax(logits)`` at every prompt position, however the prompt is chunked and
whether or not its blocks are in the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch
from engine_fixtures import fresh_engine, greedy, hf_model

from pagedq.config.sampling_params import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def eng():
    # A step takes 24 tokens at most: a 90-token prompt is prefilled over 4 steps, beside another one.
    return fresh_engine(max_num_batched_tokens=24, max_num_seqs=8)


def random_prompt(n: int) -> list[int]:
    return [random.randrange(100, 40000) for _ in range(n)]


def hf_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, by HF's own forward pass (fp32)."""
    with torch.inference_mode():
        logits = hf_model()(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def scores(out) -> list[float]:
    assert out.prompt_logprobs[0] is None
    return [e["token"][1] for e in out.prompt_logprobs[1:]]


def check_against_hf(prompt: list[int], out, top: int) -> float:
    ref = hf_prompt_logprobs(prompt)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert len(out.prompt_logprobs) == len(prompt)
    assert [e["token"][0] for e in out.prompt_logprobs[1:]] == prompt[1:]
    diff = (torch.tensor(scores(out)) - want).abs().max().item()
    assert diff < TOL, diff
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        row = ref[i]
        lp = row[prompt[i + 1]]  # its rank (1 = the most likely), up to tokens within TOL of it
        assert int((row > lp + TOL).sum()) + 1 <= entry["token"][2] <= int((row > lp - TOL).sum()) + 1
        assert len(entry["top"]) == top
        if top:
            ids, lps = zip(*entry["top"], strict=True)
            assert max(abs(a - b) for a, b in zip(lps, row.topk(top).values.tolist(), strict=True)) < TOL
            assert all(abs(row[t].item() - lp) < TOL for t, lp in zip(ids, lps, strict=True))
    return diff


def test_chunked_prefill_matches_hf(eng):
    long, short = random_prompt(90), random_prompt(30)
    eng.reset_stats()
    outs = eng.generate([long, short], [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
                                        SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0)])
    assert eng.stats.steps >= 4
    check_against_hf(long, outs[0], 2)
    check_against_hf(short, outs[1], 0)
    assert len(outs[0].output_token_ids) == 3  # and the generation goes on as usual


def test_prefix_cache_hit_is_recomputed(eng):
    prompt = random_prompt(70)
    first = eng.generate([prompt], greedy(2))[0]  # fills the prefix cache
    again = eng.generate([prompt], greedy(2))[0]
    assert again.num_cached_tokens == 64  # the blocks are there ...
    scored = eng.generate([prompt], greedy(2, prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0  # ... and a request that scores its prompt computes it whole
    check_against_hf(prompt, scored, 1)
    assert scored.output_token_ids == first.output_token_ids
    assert first.prompt_logprobs is None


def test_echo_scores_without_generating(eng):
    prompt = random_prompt(40)
    out = eng.generate([prompt], SamplingParams(max_tokens=0, echo=True, logprobs=1))[0]
    assert out.output_token_ids == [] and out.finish_reason == "length"
    check_against_hf(prompt, out, 1)
    alone = eng.generate([prompt[:1]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert alone.prompt_logprobs == [None] and alone.output_token_ids == []


def test_choices_share_choice_zeros_scores(eng):
    prompt = random_prompt(50)
    out = eng.generate([prompt], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, prompt_logprobs=0))[0]
    check_against_hf(prompt, out, 0)
    assert [o.prompt_logprobs for o in out.others] == [None, None]  # computed once, for choice 0
    assert all(len(o.output_token_ids) == 4 for o in out.others)
