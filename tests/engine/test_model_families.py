"""pagedq's own model code against transformers on small random Llama, Mistral and Qwen2 models.

Covers GQA, q/k/v bias (Qwen2), untied heads and RoPE scaling variants.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


def _rope(rope_type: str) -> dict:
    if rope_type == "default":
        return {}
    table = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    }
    return {"rope_scaling": table[rope_type]}


CASES = [
    ("llama", LlamaConfig, dict(tie_word_embeddings=False), "default"),
    ("llama-tied", LlamaConfig, dict(tie_word_embeddings=True), "default"),
    ("llama-linear", LlamaConfig, {}, "linear"),
    ("llama3-rope", LlamaConfig, {}, "llama3"),
    ("qwen2-bias", Qwen2Config, dict(tie_word_embeddings=False), "default"),
    ("qwen2-yarn", Qwen2Config, {}, "yarn"),
    ("mistral", MistralConfig, dict(sliding_window=None), "default"),
]


def _save_random_model(tmp_path, config_cls, extra: dict, rope: str):
    torch.manual_seed(0)
    cfg = config_cls(**COMMON, **extra, **_rope(rope))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if isinstance(cfg, Qwen2Config):  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path)
    from engine_fixtures import engine

    engine().tokenizer.save_pretrained(tmp_path)  # any tokenizer: the test feeds token ids
    return model


@pytest.mark.parametrize("name, config_cls, extra, rope", CASES, ids=[c[0] for c in CASES])
def test_greedy_matches_transformers(tmp_path, name, config_cls, extra, rope):
    hf = _save_random_model(tmp_path, config_cls, extra, rope)
    hf.generation_config.eos_token_id = None
    eng = LLM(Settings(model=str(tmp_path), kv_cache_memory="32MiB", max_num_batched_tokens=64))
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (5, 40, 150)]  # 150 > the chunk budget
    ours = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        ref = ref[0, len(prompt):].tolist()
        if out.output_token_ids != ref:
            # Random tiny models have flat distributions; a flip is only acceptable on an exact-ish tie.
            i = next(i for i, (a, b) in enumerate(zip(out.output_token_ids, ref, strict=True)) if a != b)
            with torch.inference_mode():
                logprobs = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1].log_softmax(-1)
            gap = (logprobs[ref[i]] - logprobs[out.output_token_ids[i]]).item()
            assert gap < 1e-4, f"{name}: token {i} differs from transformers by {gap:.2e} nats (not a tie)"


def test_unsupported_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(Settings(model=str(tmp_path)))


def test_unknown_model_name_is_rejected():
    with pytest.raises(ValueError, match="unknown model"):
        LLM(Settings(model="no/such-model"))
