"""Each served family against transformers' own greedy ``generate``, on small random models built here.

A model per family (>= 2 layers, GQA, the default tokenizer's vocabulary,
weights wide enough that greedy picks are not near-ties) is saved as a
folder; pagedq's engine runs 16 prompts of 10-300 random tokens, 32 greedy
tokens each, in one batch (chunked prefill included), and at least 15 of 16
must equal transformers token for token.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_models import (
    FAMILIES,
    MIN_IDENTICAL,
    NEW_TOKENS,
    NUM_PROMPTS,
    build_hf,
    hf_greedy,
    prompts,
    save,
)
from transformers import AutoModelForCausalLM

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine.block_manager import NULL_BLOCK
from pagedq.workers.llm import LLM
from pagedq.workers.model import loader
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.loader import resolve_model
from pagedq.workers.model.weights import INDEX_FILE


def assert_matches_transformers(path, hf, **settings) -> None:
    engine = LLM(Settings(model=str(path), kv_cache_memory="64MiB", max_num_batched_tokens=256, num_threads=1,
                          **settings))
    try:
        batch = prompts()
        ours = engine.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    finally:
        engine.shutdown()
    differ = [i for i, (p, o) in enumerate(zip(batch, ours, strict=True)) if o.output_token_ids != hf_greedy(hf, p)]
    print(f"identical to transformers on {NUM_PROMPTS - len(differ)}/{NUM_PROMPTS} prompts")
    assert NUM_PROMPTS - len(differ) >= MIN_IDENTICAL, f"prompts {differ} differ from transformers"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(tmp_path, name):
    hf = build_hf(name)
    save(hf, tmp_path)
    assert_matches_transformers(tmp_path, hf)


def test_gemma2_logprobs_follow_the_capped_logits(tmp_path):
    """Final-logit soft-capping never changes a greedy pick, only the probabilities: compare those."""
    hf = build_hf("gemma2")
    save(hf, tmp_path)
    engine = LLM(Settings(model=str(tmp_path), kv_cache_memory="16MiB", num_threads=1))
    prompt = prompts()[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5, ignore_eos=True))[0]
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    ours = dict(out.logprobs[0]["top"])
    assert set(ours) == set(want.topk(5).indices.tolist())
    assert all(abs(ours[t] - want[t].item()) < 1e-4 for t in ours), (ours, want.topk(5))


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_sliding_layers_hold_only_their_window_and_prefix_hits_stay_exact(tmp_path, name):
    """Windows (48, 96 tokens) smaller than most prompts: after every step each sliding group of each
    sequence holds at most the blocks its window reads, global groups hold every block; a second pass
    over the same prompts adopts cached prefixes (sliding groups' last blocks only) and matches again."""
    hf = build_hf(name)
    save(hf, tmp_path)
    engine = LLM(Settings(model=str(tmp_path), kv_cache_memory="64MiB", max_num_batched_tokens=256,
                          num_threads=1))
    bm, window = engine.block_manager, FAMILIES[name][1]["sliding_window"]
    assert window in bm.windows and (name == "phi3") == (None not in bm.windows)
    held, freed = [], []

    def check(_finished) -> None:
        for seq in engine.requests.values():
            if not seq.block_tables:  # waiting
                continue
            for w, table in zip(bm.windows, seq.block_tables, strict=True):
                assert len(table) == bm.blocks_needed(seq.num_computed_tokens)
                live = [b for b in table if b != NULL_BLOCK]
                if w is None:
                    assert len(live) == len(table)
                else:
                    held.append(len(live))
                    freed.append(len(table) - len(live))
                    assert len(live) <= bm.blocks_needed(window) + 1, (seq, table)

    batch = prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    try:
        first = engine.generate(batch, params, on_step=check)
        again = engine.generate(batch, params, on_step=check)
    finally:
        engine.shutdown()
    assert max(freed) > 0 and max(held) <= bm.blocks_needed(window) + 1
    assert sum(o.num_cached_tokens for o in again) > sum(len(p) for p in batch) // 2  # mostly prefix hits
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in first]
    differ = [i for i, (p, o) in enumerate(zip(batch, first, strict=True)) if o.output_token_ids != hf_greedy(hf, p)]
    assert NUM_PROMPTS - len(differ) >= MIN_IDENTICAL, f"prompts {differ} differ from transformers"


# Every family over processes (CPU, gloo): two pipeline stages (each stage's KV groups and cache tensors) and
# tensor parallel 2 (experts, fused checkpoint matrices, Gemma's norms after the all-reduce).
PARALLEL = [(name, {mode: 2}) for name in ("qwen3", "qwen3-moe", "mixtral", "gemma2", "gemma3", "phi3")
            for mode in ("pipeline_stages", "tensor_parallel")]


@pytest.mark.parametrize("name, parallel", PARALLEL, ids=[f"{n}-{next(iter(p))}" for n, p in PARALLEL])
def test_parallel_replica_matches_transformers(tmp_path, name, parallel):
    hf = build_hf(name)
    save(hf, tmp_path)
    assert_matches_transformers(tmp_path, hf, **parallel)


def test_sharded_bf16_checkpoint_served_in_fp32(tmp_path):
    """A bf16 checkpoint in several safetensors shards (with its index), an eos list in generation_config.json."""
    hf = build_hf("qwen3").to(torch.bfloat16)
    save(hf, tmp_path, max_shard_size="2MB")
    (tmp_path / "junk.safetensors").write_bytes(b"not listed in the index, never read")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint was meant to be sharded"
    assert ModelConfig.from_folder(tmp_path).eos_token_ids == (2, 7)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    assert_matches_transformers(tmp_path, reference, dtype="float32")


def test_unknown_architecture_names_it_and_the_served_list(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError) as err:
        LLM(Settings(model=str(tmp_path)))
    message = str(err.value)
    assert "GPT2LMHeadModel" in message and "Gemma3ForCausalLM" in message and "\n" not in message


def test_gguf_file_by_path_is_converted_once_and_served():
    """``--model /path/to/file.gguf``: the packaged default's own GGUF file shares its converted folder."""
    state = Settings().state_dir
    gguf = loader._gguf_file(loader.DEFAULT_MODEL)
    source = resolve_model(str(gguf), state)
    assert source.name == str(gguf)
    assert source.path == resolve_model(None, state).path
    assert ModelConfig.from_folder(source.path).architecture == "LlamaForCausalLM"
