"""Qwen3: Llama's layer with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from pagedq.workers.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_window(cls, cfg, i: int) -> int | None:
        return cfg.layer_window(i)

    def attention_options(self, i: int) -> dict:
        return {"qk_norm": True, "window": self.layer_window(self.cfg, i)}
