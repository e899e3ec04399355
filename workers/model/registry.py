"""Which class runs which architecture: config.json's ``architectures`` -> a family module's model class.

Adding a family is one module under ``workers/model/`` (a ``DecoderModel``
subclass over the shared layers in ``layers.py``) and one line in ``MODELS``
(``config/architectures.py``, which producers read too).  Modules are imported
on first use, and this module imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedq.config.architectures import MODELS, unsupported_message

if TYPE_CHECKING:  # the registry itself imports no torch
    import torch

    from pagedq.workers.engine.kv_layout import KVLayout
    from pagedq.workers.model.config import ModelConfig
    from pagedq.workers.model.decoder import DecoderModel


class UnsupportedArchitectureError(ValueError):
    pass


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
