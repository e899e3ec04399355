"""Qwen3: Llama's layer with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from pagedq.workers.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def attention_options(self, i: int) -> dict:
        return {"qk_norm": True, "window": self.cfg.layer_window(i)}
