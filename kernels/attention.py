"""The one place the model calls attention: the ``AttentionBackend`` protocol and its two backends.

``TorchPagedAttention`` (``torch_attention.py``) is the CPU path and the test
oracle; ``TritonPagedAttention`` (``triton_attention.py``) runs on GPUs.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from pagedq.kernels import torch_attention
from pagedq.kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor: ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor: ...


class TorchPagedAttention:
    """The CPU path: vectorised PyTorch (``torch_attention.py``)."""

    name = "torch"

    def __init__(self) -> None:
        self.workspace = torch_attention.Workspace()

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        torch_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        buckets = meta.plan.get("decode_buckets")
        if buckets is None:
            buckets = torch_attention.plan_decode(meta.decode_block_tables, meta.decode_context_lens,
                                                  k_cache.shape[1], q.dtype)
            meta.plan["decode_buckets"] = buckets
        return torch_attention.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, scale, buckets, self.workspace)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        buckets = meta.plan.get("prefill_buckets")
        if buckets is None:
            buckets = torch_attention.plan_prefill(meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                                   meta.prefill_block_tables, k_cache.shape[1], q.dtype)
            meta.plan["prefill_buckets"] = buckets
        return torch_attention.prefill_attention(q, k_cache, v_cache, meta.prefill_cu_seqlens_q,
                                                 meta.prefill_context_lens, meta.prefill_block_tables, scale,
                                                 buckets, self.workspace)


def paged_attention(backend: AttentionBackend, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend: decodes first, prefills after."""
    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if meta.num_prefills == 0:
        return backend.decode(q, k_cache, v_cache, meta, scale)
    if nd == 0:
        return backend.prefill(q, k_cache, v_cache, meta, scale)
    return torch.cat([backend.decode(q[:nd], k_cache, v_cache, meta, scale),
                      backend.prefill(q[nd:], k_cache, v_cache, meta, scale)])


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """``auto``: Triton on CUDA, the PyTorch path elsewhere.

    ``triton`` forces the kernels (on CPU tensors they need ``TRITON_INTERPRET=1``).
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchPagedAttention()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend=triton on CPU tensors needs TRITON_INTERPRET=1")
        from pagedq.kernels.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}: use auto, torch or triton")
