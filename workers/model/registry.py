"""Which class runs which architecture: config.json's ``architectures`` -> a family module's model class.

Adding a family is one module under ``workers/model/`` (a ``DecoderModel``
subclass over the shared layers in ``layers.py``) and one line here.  Modules
are imported on first use, and this module imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry itself imports no torch: the CPU worker checks names with it
    import torch

    from pagedq.workers.engine.kv_layout import KVLayout
    from pagedq.workers.model.config import ModelConfig
    from pagedq.workers.model.decoder import DecoderModel

# architecture -> (module under pagedq.workers.model, class name)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = frozenset(MODELS)


class UnsupportedArchitectureError(ValueError):
    pass


def unsupported_message(architectures: list[str] | set[str], name: str | None = None) -> str:
    """One line: what the model is, and what pagedq serves."""
    what = f"model {name!r} has" if name else "the model has"
    shown = ", ".join(sorted(architectures)) or "no architectures in its config.json"
    return f"{what} architecture {shown}, which pagedq does not serve; served: {', '.join(sorted(MODELS))}"


def model_class(architecture: str) -> type[DecoderModel]:
    if architecture not in MODELS:
        raise UnsupportedArchitectureError(unsupported_message([architecture]))
    module, cls = MODELS[architecture]
    return getattr(importlib.import_module(f"pagedq.workers.model.{module}"), cls)


def cache_layout(cfg: ModelConfig) -> KVLayout:
    """The KV groups of ``cfg``'s layers (which slide, which attend globally): ``kv_layout.py``."""
    return model_class(cfg.architecture).cache_layout(cfg)


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], layer_range: tuple[int, int] | None = None,
                **kwargs) -> DecoderModel:
    """The model class for ``cfg.architecture`` over ``weights`` (all layers, or one stage's / shard's)."""
    return model_class(cfg.architecture)(cfg, weights, layer_range, **kwargs)
