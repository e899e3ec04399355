"""Paged-attention kernels: Triton on GPUs, a PyTorch reference on CPUs."""

from pagedq.kernels.attention import TorchPagedAttention, get_attention_backend, paged_attention
from pagedq.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "TorchPagedAttention", "get_attention_backend", "paged_attention"]
