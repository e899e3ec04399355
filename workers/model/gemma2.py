"""Gemma 2: embeddings scaled by sqrt(hidden), RMSNorm with a (1 + w) weight, GELU-tanh gated MLP, norms
before and after both attention and MLP, ``query_pre_attn_scalar``, soft-capped attention scores and final
logits, sliding-window layers interleaved with global ones (``layer_types``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq.kernels import AttentionMetadata
from pagedq.workers.model.decoder import DecoderModel
from pagedq.workers.model.layers import Attention, GatedMLP, load_attention, load_mlp, rms_norm


@dataclass
class GemmaLayer:
    input_norm: torch.Tensor
    attn: Attention
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    mlp: GatedMLP
    post_ff_norm: torch.Tensor


class Gemma2ForCausalLM(DecoderModel):
    norm_offset = 1.0
    sliding_pattern = 2  # without layer_types in config.json: every n-th layer is global, the others slide
    qk_norm = False
    softcaps = (50.0, 30.0)  # transformers' defaults (attention, final logits) when config.json omits them

    def softcap(self, key: str, default: float | None) -> float | None:
        return self.cfg.hf.get(key, default)  # a null in config.json turns capping off

    def __init__(self, cfg, weights, *args, **kwargs) -> None:
        super().__init__(cfg, weights, *args, **kwargs)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype, device=self.device)

    @classmethod
    def layer_type(cls, cfg, i: int) -> str:
        types = cfg.get("layer_types")
        if types:
            return types[i]
        pattern = cfg.get("sliding_window_pattern", cls.sliding_pattern)
        return "sliding_attention" if (i + 1) % pattern else "full_attention"

    @classmethod
    def layer_window(cls, cfg, i: int) -> int | None:
        return cfg.get("sliding_window") if cls.layer_type(cfg, i) == "sliding_attention" else None

    def attention_options(self, i: int) -> dict:
        cfg = self.cfg
        return {"scale": cfg.get("query_pre_attn_scalar", 256) ** -0.5,
                "softcap": self.softcap("attn_logit_softcapping", self.softcaps[0]),
                "window": self.layer_window(cfg, i)}

    def load_layer(self, i: int) -> GemmaLayer:
        p, cfg = f"model.layers.{i}.", self.cfg
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
        return GemmaLayer(
            input_norm=self.norm_weight(p + "input_layernorm.weight"),
            attn=load_attention(self.w, p + "self_attn.", cfg, self.shard, bias=cfg.attention_bias,
                                qk_norm=self.qk_norm, norm_offset=self.norm_offset, **self.attention_options(i)),
            post_attn_norm=self.norm_weight(p + "post_attention_layernorm.weight"),
            pre_ff_norm=self.norm_weight(p + "pre_feedforward_layernorm.weight"),
            mlp=load_mlp(self.w, p + "mlp.", slice(*self.shard.mlp), act),
            post_ff_norm=self.norm_weight(p + "post_feedforward_layernorm.weight"),
        )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed) * self.embed_scale

    def layer_forward(self, layer: GemmaLayer, hidden: torch.Tensor, ropes: dict, meta: AttentionMetadata,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        attn = self._reduce(layer.attn(self.attention, rms_norm(hidden, layer.input_norm, eps), ropes, meta,
                                       k_cache, v_cache))
        hidden = hidden + rms_norm(attn, layer.post_attn_norm, eps)
        mlp = self._reduce(layer.mlp(self.matmul, rms_norm(hidden, layer.pre_ff_norm, eps)))
        return hidden + rms_norm(mlp, layer.post_ff_norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.softcap("final_logit_softcapping", self.softcaps[1])
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits
