"""``DecoderModel``: what every family shares around its layers.

A model holds a contiguous range of layers (a pipeline stage: the first
stage embeds tokens, the last one normalises and computes logits) and,
optionally, one tensor-parallel ``Shard`` of each.  A family subclasses it
and says how to load one layer (``load_layer``) and run it
(``layer_forward``); embeddings, RoPE tables, the final norm and the logits
can be adjusted through the class attributes and hooks below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedq.kernels import AttentionMetadata
from pagedq.workers.engine.kv_layout import KVLayout, kv_layout
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.layers import Matmul, Rotary, Shard, rms_norm


class DecoderModel:
    """A stack of decoder layers ``layer_range`` of the model, with embed/head on the ends."""

    norm_offset = 0.0  # added to every RMSNorm weight at load: 1.0 for Gemma's (1 + w)

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer_range: tuple[int, int] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, attention=None,
                 shard: Shard | None = None) -> None:
        self.cfg = cfg
        self.first, self.last = layer_range or (0, cfg.num_layers)
        self.is_first_stage = self.first == 0
        self.is_last_stage = self.last == cfg.num_layers
        self.attention = attention
        self.shard = shard or Shard.full(cfg)
        self.tp_group = self.shard.group if self.shard.size > 1 else None
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        self.device, self.dtype = device, dtype
        self._weights = weights
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = self.w("model.embed_tokens.weight") if self.is_first_stage or tied else None
        if self.is_last_stage:
            self.norm = self.norm_weight("model.norm.weight")
            self.lm_head = self.embed if tied else self.w("lm_head.weight")
        self.rotary = self.make_rotary()
        self.layers = [self.load_layer(i) for i in range(self.first, self.last)]
        self.kv_groups = self.cache_layout(cfg).layer_group[self.first:self.last]  # each layer's KV group
        self.matmul = Matmul()
        del self._weights

    # --- loading ------------------------------------------------------------------------------------------------
    def w(self, name: str) -> torch.Tensor:
        """A checkpoint tensor on this model's device, in its dtype (bf16/fp16 checkpoints are cast here)."""
        return self._weights[name].to(device=self.device, dtype=self.dtype).contiguous()

    def norm_weight(self, name: str) -> torch.Tensor:
        weight = self.w(name)
        return weight + self.norm_offset if self.norm_offset else weight

    def make_rotary(self) -> dict[str, Rotary]:
        """The RoPE tables the layers use, by name (``Attention.rope``)."""
        return {"default": Rotary(self.cfg, self.device, self.dtype)}

    def load_layer(self, i: int):
        raise NotImplementedError

    @classmethod
    def layer_window(cls, cfg: ModelConfig, i: int) -> int | None:
        """Layer ``i``'s sliding window (it attends to the last ``window`` positions), or None: global."""
        return None

    @classmethod
    def cache_layout(cls, cfg: ModelConfig) -> KVLayout:
        """The KV groups of this model's layers (``kv_layout.py``): one unless some layers slide."""
        return kv_layout([cls.layer_window(cfg, i) for i in range(cfg.num_layers)])

    # --- running ------------------------------------------------------------------------------------------------
    def layer_forward(self, layer, hidden: torch.Tensor, ropes: dict, meta: AttentionMetadata,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run this stage's layers over ``hidden [num_tokens, hidden_size]``."""
        ropes = {name: rotary.lookup(positions) for name, rotary in self.rotary.items()}
        for layer, (k_cache, v_cache), group in zip(self.layers, kv_caches, self.kv_groups, strict=True):
            hidden = self.layer_forward(layer, hidden, ropes, meta.group(group), k_cache, v_cache)
        return hidden

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel product over this stage's shards (a no-op unsharded)."""
        if self.tp_group is not None:
            self.tp_group.allreduce([partial]).wait()
        return partial

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in a reused buffer: valid until the next call."""
        return self.matmul("logits", rms_norm(hidden, self.norm, self.cfg.rms_norm_eps), self.lm_head)
