"""Gemma 3 (text): Gemma 2's layer with (1 + w) RMSNorms on q and k, no soft-capping by default, five
sliding-window layers per global one, and a separate RoPE base (and scaling) for the sliding layers."""

from __future__ import annotations

from pagedq.workers.model.gemma2 import Gemma2ForCausalLM
from pagedq.workers.model.layers import Rotary


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    sliding_pattern = 6
    qk_norm = True
    softcaps = (None, None)

    def make_rotary(self) -> dict[str, Rotary]:
        cfg, params = self.cfg, self.cfg.get("rope_parameters", {})
        tables = {}
        for kind in ("full_attention", "sliding_attention"):
            if kind in params:  # transformers 5: one RoPE per layer type
                rope = params[kind]
                theta = rope.get("rope_theta")
            elif kind == "full_attention":  # older configs: rope_theta / rope_scaling for global layers
                rope, theta = cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 1_000_000.0)
            else:
                rope, theta = {}, cfg.get("rope_local_base_freq", 10_000.0)
            kind_of = rope.get("rope_type", rope.get("type", "default"))
            scaling = None if kind_of == "default" else {**rope, "rope_type": kind_of}
            tables[kind] = Rotary(cfg, self.device, self.dtype, theta=theta, scaling=scaling)
        return tables

    def attention_options(self, i: int) -> dict:
        return {**super().attention_options(i), "rope": self.layer_type(self.cfg, i)}
