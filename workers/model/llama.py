"""Llama, Mistral and Qwen2: pre-norm decoder layers, SiLU-gated MLP, GQA, RoPE (linear / llama3 / yarn).

q/k/v and gate/up projections are fused into one matrix each, so a layer is
four matrix products; Qwen2 adds a q/k/v bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedq.kernels import AttentionMetadata
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.decoder import DecoderModel
from pagedq.workers.model.layers import (  # noqa: F401  (re-exported: older imports name them here)
    Attention,
    GatedMLP,
    Shard,
    apply_rope,
    load_attention,
    load_mlp,
    rms_norm,
    rope_inv_freq,
    split_evenly,
)
from pagedq.workers.model.weights import load_weights  # noqa: F401


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    attn: Attention
    post_norm: torch.Tensor
    mlp: GatedMLP


class LlamaForCausalLM(DecoderModel):
    def load_layer(self, i: int) -> DecoderLayer:
        p, cfg = f"model.layers.{i}.", self.cfg
        return DecoderLayer(
            input_norm=self.norm_weight(p + "input_layernorm.weight"),
            attn=load_attention(self.w, p + "self_attn.", cfg, self.shard, bias=cfg.attention_bias,
                                **self.attention_options(i)),
            post_norm=self.norm_weight(p + "post_attention_layernorm.weight"),
            mlp=self.load_mlp(p, i),
        )

    def attention_options(self, i: int) -> dict:
        """Per-layer attention settings a family adds (q/k norm, window, ...)."""
        return {}

    def load_mlp(self, prefix: str, i: int):
        """Layer ``i``'s feed-forward block: a gated MLP here, experts in the mixture-of-experts families."""
        return load_mlp(self.w, prefix + "mlp.", slice(*self.shard.mlp), self.cfg.get("hidden_act", "silu"))

    def layer_forward(self, layer: DecoderLayer, hidden: torch.Tensor, ropes: dict, meta: AttentionMetadata,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        hidden = hidden + self._reduce(layer.attn(self.attention, rms_norm(hidden, layer.input_norm, eps), ropes,
                                                  meta, k_cache, v_cache))
        return hidden + self._reduce(layer.mlp(self.matmul, rms_norm(hidden, layer.post_norm, eps)))


CausalLM = LlamaForCausalLM  # the name this class had when it was the only family

__all__ = ["CausalLM", "DecoderLayer", "LlamaForCausalLM", "ModelConfig", "Shard", "load_weights"]
