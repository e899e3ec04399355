"""Grammar-constrained decoding in the engine, in process, with SmolLM2-135M (greedy).

Constrained and unconstrained requests share batches: the unconstrained ones
must not change at all, and every constrained output must parse and validate.
Schemas are bounded (enums, maxLength, maxItems) so a 135M model finishes
well within max_tokens.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from engine_fixtures import engine, fresh_engine, greedy, settings, sharegpt_prompts

from pagedq.config.constraints import canonical_json
from pagedq.config.messages import RequestError
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine.sequence import Sequence
from pagedq.workers.llm import grammar_unsupported
from pagedq.workers.model.sampler import apply_grammar_masks

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "mood", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "mood": {"enum": ["happy", "sad", "calm"]},
                         "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "capital"],
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "country": {"type": "string", "maxLength": 16},
                       "capital": {"type": "boolean"}}}


def chat_prompt(llm, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def constrained(kind: str, text: str, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, constraint=[kind, text])


CASES = [  # (question, params, check of the text)
    ("Describe a person called Ann as JSON.", constrained("json_schema", canonical_json(PERSON)),
     lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ("Give a city in France as JSON.", constrained("json_schema", canonical_json(CITY)),
     lambda t: jsonschema.validate(json.loads(t), CITY)),
    ("Reply with a JSON object with the keys name and age for Bob.", constrained("json_object", ""),
     lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    ("Make up a phone number.", constrained("regex", r"[0-9]{3}-[0-9]{4}"),
     lambda t: len(t) == 8 and t[3] == "-" or pytest.fail(t)),
    ("Is the sky green?", constrained("choice", json.dumps(["yes", "no", "maybe"])),
     lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
]


def case_prompts(llm) -> list[list[int]]:
    return [chat_prompt(llm, question) for question, _, _ in CASES]


def check_outputs(outs) -> None:
    for out, (_, params, check) in zip(outs, CASES, strict=True):
        assert out.finish_reason == "stop", (params.constraint, out.text)
        check(out.text)


def run_constrained(llm):
    outs = llm.generate(case_prompts(llm), [params for _, params, _ in CASES])
    check_outputs(outs)
    return outs


def test_mixed_batch_leaves_unconstrained_requests_unchanged_and_constrained_ones_valid():
    llm = engine()
    free = sharegpt_prompts()[:6]
    alone = [o.output_token_ids for o in llm.generate(free, greedy(24))]
    mixed = llm.generate(free + case_prompts(llm), [greedy(24)] * len(free) + [p for _, p, _ in CASES])
    assert [o.output_token_ids for o in mixed[:len(free)]] == alone
    check_outputs(mixed[len(free):])
    # Alone, the constrained requests give the same tokens as in the mixed batch.
    by_itself = run_constrained(llm)
    assert [o.output_token_ids for o in by_itself] == [o.output_token_ids for o in mixed[len(free):]]


def test_preemption_gives_the_same_constrained_output():
    want = [o.output_token_ids for o in run_constrained(engine())]
    small = fresh_engine(num_kv_blocks=12, enable_prefix_caching=False)
    got = run_constrained(small)
    assert small.stats.preemptions > 0, "the KV budget was meant to force preemption"
    assert [o.output_token_ids for o in got] == want


def test_logprobs_stay_the_models_own_distribution():
    llm = engine()
    prompt = chat_prompt(llm, CASES[0][0])
    free = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
    json_first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=3,
                                                       constraint=["json_object", ""]))[0]
    assert json_first.logprobs[0]["top"] == free.logprobs[0]["top"]  # the mask does not renormalise logprobs
    assert llm.tokenizer.decode(json_first.output_token_ids).startswith("{")


def test_constraint_refused_with_ignore_eos_uncompilable_or_distributed():
    llm = engine()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, constraint=["json_object", ""])
    with pytest.raises(RequestError) as e:
        llm.add_request("x", [1, 2, 3], params)
    assert e.value.param == "ignore_eos"
    with pytest.raises(RequestError) as e:
        llm.add_request("x", [1, 2, 3], constrained("regex", "(unclosed"))
    assert e.value.param == "response_format"
    assert not llm.has_unfinished()
    assert "pipeline_stages" in grammar_unsupported(settings(pipeline_stages=2))
    assert grammar_unsupported(settings()) is None


class AllowOnly:
    """A stand-in grammar that allows a fixed set of tokens (the sampler's side of the contract alone)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill(self, bitmask: torch.Tensor, row: int, output_token_ids: list[int]) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)


def test_mask_sets_exactly_the_disallowed_tokens_of_constrained_rows_to_minus_inf():
    vocab = 100
    logits = torch.randn(3, vocab)
    seqs = [Sequence("a", [1], SamplingParams(), grammar=AllowOnly([5, 31, 95])), Sequence("b", [1], SamplingParams()),
            Sequence("c", [1], SamplingParams(), grammar=AllowOnly([0]))]
    masked = logits.clone()
    apply_grammar_masks(masked, seqs)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [5, 31, 95]
    assert torch.equal(masked[0, [5, 31, 95]], logits[0, [5, 31, 95]])
    assert torch.equal(masked[1], logits[1])  # unconstrained: untouched
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [0]


def test_a_greedy_row_whose_best_token_is_allowed_is_left_unmasked():
    vocab = 100
    logits = torch.randn(2, vocab)
    best = logits.argmax(dim=-1).tolist()
    other = [(b + 7) % vocab for b in best]
    seqs = [Sequence("fits", [1], greedy(4), grammar=AllowOnly([best[0], other[0]])),
            Sequence("does-not", [1], greedy(4), grammar=AllowOnly([other[1]]))]
    masked = logits.clone()
    apply_grammar_masks(masked, seqs)
    assert torch.equal(masked[0], logits[0])  # its argmax is allowed: the masked argmax is the same token
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [other[1]]
    assert masked.argmax(dim=-1).tolist() == [best[0], other[1]]


def test_a_grammar_not_compiled_in_time_fails_its_request_and_the_next_compiles():
    """The compile timeout: a fresh schema given no time is refused naming response_format (a TimeoutError from
    the backend); the backend stays usable, and the same schema compiles within the default timeout."""
    from pagedq.workers.grammar import GrammarBackend

    llm = engine()
    props = {f"field_{random.randrange(1 << 40):x}": {"type": "string", "maxLength": 40} for _ in range(40)}
    schema = canonical_json({"type": "object", "properties": props, "required": sorted(props)})
    hurried = GrammarBackend(llm.tokenizer, llm.cfg.vocab_size, llm.engine.config.eos_token_ids,
                             compile_timeout_s=1e-6)
    with pytest.raises(TimeoutError, match="not compiled within"):
        hurried.new_state(["json_schema", schema])
    hurried.compile_timeout_s = 60.0
    assert hurried.new_state(["json_schema", schema]).accepted == []
    hurried.compile_timeout_s = 1e-6
    llm.engine.new_grammar = hurried.new_state
    try:
        with pytest.raises(RequestError, match="not compiled within") as e:
            llm.add_request("late", [1, 2, 3], constrained("json_schema", schema.replace("field_", "other_")))
    finally:
        llm.engine.new_grammar = llm.new_grammar
    assert e.value.param == "response_format" and not llm.has_unfinished()
