"""A model folder's config.json (and generation_config.json), read once into one ``ModelConfig``.

The fields every family uses are typed; the rest of config.json stays in
``hf`` for the family modules that need more (Gemma's soft-capping, the
mixture-of-experts sizes, ...).  ``ModelConfig`` travels as JSON to the other
processes of a parallel replica, so it holds only JSON values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None  # caps the context of models whose every layer slides (Mistral); see layer_window
    hf: dict = field(default_factory=dict)  # config.json as read

    def get(self, key: str, default: Any = None) -> Any:
        """A config.json value; ``default`` when it is missing or null."""
        value = self.hf.get(key)
        return default if value is None else value

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` when config.json's ``layer_types`` marks it sliding."""
        types = self.hf.get("layer_types")
        if types and types[layer] == "sliding_attention":
            return self.hf.get("sliding_window")
        return None

    @classmethod
    def from_folder(cls, path: Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        gen_file = Path(path) / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        num_heads = raw["num_attention_heads"]
        window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            sliding_window=window,
            hf=raw,
        )
