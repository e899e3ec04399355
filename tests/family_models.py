"""Small random models of each served family, built by transformers at test time, and their greedy reference.

A model per family (>= 2 layers, GQA, the default tokenizer's vocabulary,
weights wide enough that greedy picks are not near-ties; MoE with 8 experts,
top-2) is saved as a folder with the default tokenizer.  Used by
``tests/engine/test_families.py`` (the engine) and ``tests/e2e/test_families_queue.py`` (the whole queue).
"""

from __future__ import annotations

import functools

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
from pagedq.workers.model.loader import resolve_model

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
