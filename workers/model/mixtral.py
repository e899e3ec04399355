"""Mixtral: Mistral's attention; a mixture of experts (``w1``/``w3``/``w2``) whose top-k weights always sum to 1."""

from __future__ import annotations

from pagedq.workers.model.layers import load_moe
from pagedq.workers.model.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_window(cls, cfg, i: int) -> int | None:
        return cfg.get("sliding_window")

    def attention_options(self, i: int) -> dict:
        return {"window": self.layer_window(self.cfg, i)}

    def load_mlp(self, prefix: str, i: int):
        cfg = self.cfg
        return load_moe(self.w, prefix + "block_sparse_moe.", cfg.get("num_local_experts"),
                        self.shard.columns(cfg.intermediate_size), cfg.get("hidden_act", "silu"),
                        top_k=cfg.get("num_experts_per_tok"), renormalize=True, names=("w1", "w3", "w2"))
