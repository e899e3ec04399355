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
    """``window``: attend to the last ``window`` positions only (sliding-window layers); ``softcap``: Gemma 2's
    ``tanh(scores / softcap) * softcap``.  A backend without ``supports_window_softcap`` leaves such layers to
    the PyTorch path (same cache layout)."""

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
    supports_window_softcap = True

    def __init__(self) -> None:
        self.workspace = torch_attention.Workspace()

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        torch_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        key = "decode_buckets" if window is None else f"decode_buckets_{window}"
        buckets = meta.plan.get(key)
        if buckets is None:
            buckets = torch_attention.plan_decode(meta.decode_block_tables, meta.decode_context_lens,
                                                  k_cache.shape[1], q.dtype, window)
            meta.plan[key] = buckets
        return torch_attention.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_context_lens, scale, buckets, self.workspace, softcap)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        key = "prefill_buckets" if window is None else f"prefill_buckets_{window}"
        buckets = meta.plan.get(key)
        if buckets is None:
            buckets = torch_attention.plan_prefill(meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                                   meta.prefill_block_tables, k_cache.shape[1], q.dtype, window)
            meta.plan[key] = buckets
        return torch_attention.prefill_attention(q, k_cache, v_cache, meta.prefill_cu_seqlens_q,
                                                 meta.prefill_context_lens, meta.prefill_block_tables, scale,
                                                 buckets, self.workspace, softcap)


_fallback: TorchPagedAttention | None = None


def _attend_with(backend: AttentionBackend, window: int | None, softcap: float | None):
    """The backend that attends: ``backend`` itself, or the PyTorch path for what it cannot do."""
    global _fallback
    if window is None and softcap is None:
        return backend, {}
    if getattr(backend, "supports_window_softcap", False):
        return backend, {"window": window, "softcap": softcap}
    if _fallback is None:
        _fallback = TorchPagedAttention()
    return _fallback, {"window": window, "softcap": softcap}


def paged_attention(backend: AttentionBackend, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend: decodes first, prefills after."""
    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    attend, kw = _attend_with(backend, window, softcap)
    nd = meta.num_decode_tokens
    if meta.num_prefills == 0:
        return attend.decode(q, k_cache, v_cache, meta, scale, **kw)
    if nd == 0:
        return attend.prefill(q, k_cache, v_cache, meta, scale, **kw)
    return torch.cat([attend.decode(q[:nd], k_cache, v_cache, meta, scale, **kw),
                      attend.prefill(q[nd:], k_cache, v_cache, meta, scale, **kw)])


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
