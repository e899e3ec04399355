"""Greedy outputs are token-identical to Hugging Face transformers' generate on the same weights."""

from __future__ import annotations

import functools
import random

import pytest
from engine_fixtures import NUM_PROMPTS, fresh_engine, greedy, hf_greedy, sharegpt_prompts

NEW_TOKENS = 48


@functools.lru_cache(maxsize=1)
def reference() -> list[list[int]]:
    return [hf_greedy(p, NEW_TOKENS) for p in sharegpt_prompts()]


def assert_identical(outputs: list[list[int]]) -> None:
    expected = reference()
    assert len(outputs) == len(expected) == NUM_PROMPTS
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from HF, e.g. {outputs[mismatched[0]]} vs {expected[mismatched[0]]}"


def test_alone():
    """A fresh sample of six prompts, each run by itself (all of them take minutes; the other tests run them all)."""
    engine = fresh_engine()
    prompts, expected = sharegpt_prompts(), reference()
    for i in random.sample(range(len(prompts)), 6):
        assert engine.generate([prompts[i]], greedy(NEW_TOKENS))[0].output_token_ids == expected[i], f"prompt {i}"


def test_all_together():
    engine = fresh_engine()
    outs = engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS))
    assert engine.stats.steps < 2 * NEW_TOKENS, "the requests should have shared steps"
    assert_identical([o.output_token_ids for o in outs])


def test_shuffled_arrival_while_running():
    """Requests arrive in random order, a few at a time, while earlier ones are mid-decode."""
    engine = fresh_engine()
    prompts = sharegpt_prompts()
    order = random.sample(range(len(prompts)), len(prompts))
    results: dict[str, list[int]] = {}
    while order or engine.has_unfinished():
        k = random.randint(0, 4)
        arriving, order = order[:k], order[k:]
        for i in arriving:
            engine.add_request(str(i), prompts[i], greedy(NEW_TOKENS))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.output_token_ids
    assert_identical([results[str(i)] for i in range(len(prompts))])


@pytest.mark.parametrize("num_blocks", [48])
def test_preemption_under_small_kv_budget(num_blocks):
    engine = fresh_engine(num_kv_blocks=num_blocks, enable_prefix_caching=False)
    outs = engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS))
    preemptions = engine.stats.preemptions
    print(f"preemptions with {num_blocks} KV blocks: {preemptions}")
    assert preemptions > 0, "the KV budget was meant to force preemption"
    assert_identical([o.output_token_ids for o in outs])
