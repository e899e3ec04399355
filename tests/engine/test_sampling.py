"""Sampling: the engine's own checks, filtering, penalties, seeds, logprobs (the schema is tests/unit)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from engine_fixtures import engine, greedy, hf_model, sharegpt_prompts

from pagedq.config.messages import RequestError
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine.sequence import Sequence
from pagedq.workers.model.sampler import apply_penalties, apply_top_k_top_p_min_p


def test_engine_rejects_prompts_it_cannot_run():
    eng = engine()
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("x", [], greedy(4))
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request("x", [1] * (eng.max_model_len - 2), greedy(4))
    with pytest.raises(RequestError, match="token ids"):
        eng.add_request("x", [eng.cfg.vocab_size + 1], greedy(4))
    assert not eng.has_unfinished()


def _seq(params: SamplingParams, tokens=(1, 2, 3)) -> Sequence:
    return Sequence("s", list(tokens), params)


def test_top_k_top_p_min_p_masks():
    vocab = 50
    logits = torch.randn(3, vocab) * 3
    seqs = [_seq(SamplingParams(top_k=5)), _seq(SamplingParams(top_p=0.6)), _seq(SamplingParams(min_p=0.2))]
    out = apply_top_k_top_p_min_p(logits.clone(), seqs)
    kept = torch.isfinite(out)
    assert kept[0].sum() == 5 and set(kept[0].nonzero().flatten().tolist()) == set(logits[0].topk(5).indices.tolist())
    probs = logits[1].softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    need = int((sorted_p.cumsum(0) < 0.6).sum()) + 1  # smallest prefix reaching 0.6
    assert set(kept[1].nonzero().flatten().tolist()) == set(order[:need].tolist())
    p2 = logits[2].softmax(-1)
    assert set(kept[2].nonzero().flatten().tolist()) == set((p2 >= 0.2 * p2.max()).nonzero().flatten().tolist())
    assert torch.equal(out[kept], logits[kept]), "surviving logits are unchanged"


def test_penalties_match_their_definitions():
    vocab = 20
    logits = torch.randn(1, vocab) + 0.5
    seq = Sequence("s", [3, 4], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    seq.token_ids += [5, 5, 6]  # outputs: 5 twice, 6 once
    out = logits.clone()
    apply_penalties(out, [seq], torch.tensor([0]))
    want = logits.clone()[0]
    for t in (3, 4, 5, 6):
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[5] -= 0.25 * 2 + 0.5
    want[6] -= 0.25 * 1 + 0.5
    assert torch.allclose(out[0], want)


def test_logit_bias_bans_and_forces_tokens_and_leaves_batch_mates_alone():
    eng = engine()
    prompts = sharegpt_prompts()[:3]
    plain_out = eng.generate(prompts, greedy(8, logprobs=0))
    plain = [o.output_token_ids for o in plain_out]
    banned = plain[0][0]
    forced = random.choice([t for t in range(100, eng.cfg.vocab_size) if t not in plain[1]])
    params = [replace(greedy(8), logit_bias={banned: -100.0}),
              replace(greedy(8), logit_bias={forced: 100.0}, logprobs=0), greedy(8)]
    got = eng.generate(prompts, params)
    assert got[0].output_token_ids[0] != banned and banned not in got[0].output_token_ids
    assert got[1].output_token_ids == [forced] * 8
    assert got[2].output_token_ids == plain[2], "a batch mate without a bias is unchanged"
    # logprobs stay the model's own: the forced first token is less probable than the unbiased argmax
    assert [lp["token"][0] for lp in got[1].logprobs] == [forced] * 8
    assert got[1].logprobs[0]["token"][1] < plain_out[1].logprobs[0]["token"][1] - 1
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request("x", prompts[0], replace(greedy(4), logit_bias={eng.cfg.vocab_size: 5.0}))


def test_degenerate_sampling_equals_greedy():
    eng = engine()
    prompts = sharegpt_prompts()[:4]
    want = [o.output_token_ids for o in eng.generate(prompts, greedy(12))]
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        got = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, **extra))
        assert [o.output_token_ids for o in got] == want, extra


def test_seeded_request_is_reproducible_regardless_of_batch_mates():
    eng = engine()
    prompts = sharegpt_prompts()
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = eng.generate([prompts[0]], seeded)[0].output_token_ids
    mates = [SamplingParams(max_tokens=random.randint(5, 30), temperature=0.9, ignore_eos=True) for _ in range(5)]
    crowd = eng.generate([prompts[0]] + prompts[1:6], [seeded] + mates)
    assert crowd[0].output_token_ids == alone
    other_seed = eng.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=1.0, seed=99,
                                                           ignore_eos=True))[0]
    assert other_seed.output_token_ids != alone


def test_unseeded_sampling_varies():
    eng = engine()
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    outs = eng.generate([sharegpt_prompts()[0]] * 4, params)
    assert len({tuple(o.output_token_ids) for o in outs}) > 1


def test_repetition_penalty_reduces_repeats():
    eng = engine()
    prompt = eng.tokenizer("list list list list list list", add_special_tokens=False)["input_ids"]
    plain = eng.generate([prompt], greedy(30))[0].output_token_ids
    penalised = eng.generate([prompt], greedy(30, repetition_penalty=1.8))[0].output_token_ids
    assert len(set(penalised)) > len(set(plain))


def test_logprobs_match_hf_distribution():
    eng = engine()
    prompt = sharegpt_prompts()[2]
    out = eng.generate([prompt], greedy(3, logprobs=5))[0]
    assert len(out.logprobs) == 3
    with torch.inference_mode():
        logits = hf_model()(torch.tensor([prompt])).logits[0, -1]
    ref = logits.log_softmax(-1).topk(5)
    first = out.logprobs[0]
    assert [t for t, _ in first["top"]] == ref.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in first["top"]]), ref.values, atol=1e-4)
    assert first["token"][0] == out.output_token_ids[0] == ref.indices[0].item()
