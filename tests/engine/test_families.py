"""Each served family against transformers' own greedy ``generate``, on small random models built here.

A model per family (>= 2 layers, GQA, the default tokenizer's vocabulary,
weights wide enough that greedy picks are not near-ties) is saved as a
folder; pagedq's engine runs 16 prompts of 10-300 random tokens, 32 greedy
tokens each, in one batch (chunked prefill included), and at least 15 of 16
must equal transformers token for token.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    MixtralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM
from pagedq.workers.model import loader
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.loader import resolve_model
from pagedq.workers.model.weights import INDEX_FILE

NUM_PROMPTS, NEW_TOKENS, MIN_IDENTICAL = 16, 32, 15
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.15,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


@functools.lru_cache(maxsize=1)
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(None, Settings().state_dir).path)


def _long_rope_factors(n: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    return {"short_factor": (1 + torch.rand(n, generator=gen)).tolist(),
            "long_factor": (2 + 4 * torch.rand(n, generator=gen)).tolist()}


FAMILIES = {
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=False)),
    "qwen3-tied": (Qwen3Config, dict(tie_word_embeddings=True, num_hidden_layers=3)),
    "qwen3-moe": (Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                        num_hidden_layers=3)),
    "mixtral": (MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2)),
    # Windows smaller than most prompts: sliding layers must drop the keys that fall out.
    "gemma2": (Gemma2Config, dict(sliding_window=48, num_hidden_layers=4, query_pre_attn_scalar=16,
                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": (Gemma3TextConfig, dict(sliding_window=48, num_hidden_layers=3, query_pre_attn_scalar=24,
                                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 100_000.0},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10_000.0}})),
    "phi3": (Phi3Config, dict(sliding_window=96, max_position_embeddings=8192, original_max_position_embeddings=4096,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                               "partial_rotary_factor": 0.5, **_long_rope_factors(4)})),
}


def build_hf(name: str):
    config_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = config_cls(**{**SMALL, "vocab_size": len(tokenizer()), **extra})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma's 1 + w); spread them so they matter
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None  # run past EOS like ignore_eos
    return model


def save(model, path, **kw) -> None:
    model.save_pretrained(path, **kw)
    tokenizer().save_pretrained(path)  # the engine loads one; the test feeds token ids


def prompts() -> list[list[int]]:
    lengths = torch.randint(10, 301, (NUM_PROMPTS,)).tolist()
    vocab = len(tokenizer())
    return [torch.randint(3, vocab, (n,)).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


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


# Every family over processes (CPU, gloo) once: tensor parallel where its sharding is special (experts,
# fused checkpoint matrices, Gemma's norms after the all-reduce), two pipeline stages for the others.
PARALLEL = [("qwen3", dict(pipeline_stages=2)), ("qwen3-moe", dict(tensor_parallel=2)),
            ("mixtral", dict(pipeline_stages=2)), ("gemma2", dict(tensor_parallel=2)),
            ("gemma3", dict(pipeline_stages=2)), ("phi3", dict(tensor_parallel=2))]


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
