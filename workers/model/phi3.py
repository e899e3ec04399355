"""Phi-3: Llama's layer with q/k/v fused in one ``qkv_proj`` and gate/up in one ``gate_up_proj`` in the
checkpoint, LongRoPE ("su") scaling, a partial rotary factor, and a sliding window over every layer."""

from __future__ import annotations

from pagedq.workers.model.layers import load_mlp
from pagedq.workers.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_window(cls, cfg, i: int) -> int | None:
        return cfg.get("sliding_window")

    def attention_options(self, i: int) -> dict:
        return {"fused_qkv": True, "window": self.layer_window(self.cfg, i)}

    def load_mlp(self, prefix: str, i: int):
        return load_mlp(self.w, prefix + "mlp.", slice(*self.shard.mlp), self.cfg.get("hidden_act", "silu"),
                        fused=True)
