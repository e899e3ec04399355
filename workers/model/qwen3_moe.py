"""Qwen3-MoE: Qwen3's attention; a mixture of experts in place of the MLP (``decoder_sparse_step``,
``mlp_only_layers`` keep some layers dense), top-k renormalised when ``norm_topk_prob``."""

from __future__ import annotations

from pagedq.workers.model.layers import load_moe
from pagedq.workers.model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def load_mlp(self, prefix: str, i: int):
        cfg = self.cfg
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts", 0)
        sparse = (i not in cfg.get("mlp_only_layers", []) and num_experts > 0
                  and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return super().load_mlp(prefix, i)
        width = cfg.get("moe_intermediate_size")
        return load_moe(self.w, prefix + "mlp.", num_experts, self.shard.columns(width), cfg.get("hidden_act", "silu"),
                        top_k=cfg.get("num_experts_per_tok"), renormalize=bool(cfg.get("norm_topk_prob", False)))
