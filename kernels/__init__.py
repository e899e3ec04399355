"""Paged-attention kernels: Triton on GPUs, PyTorch on CPUs (and as the test oracle)."""

from pagedq.kernels.attention import (
    AttentionBackend,
    TorchPagedAttention,
    get_attention_backend,
    paged_attention,
)
from pagedq.kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "get_attention_backend", "paged_attention"]
