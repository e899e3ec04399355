"""PyTorch paged attention: the CPU path and the oracle for the Triton kernels.

KV caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``.  A
sequence's keys live in the blocks its block table lists, in order.

Decode attention gathers each sequence's blocks into a padded batch and calls
``scaled_dot_product_attention``.  To keep padding small, sequences are cut
into buckets of similar length (the engine sorts decodes by length, so a
bucket is a contiguous slice); the loop is over buckets, never sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BUCKET_MAX_SEQS = 32
BUCKET_SLACK_BLOCKS = 2  # a bucket's longest sequence may exceed its shortest by this many blocks (or 25%)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, kv_heads, head_dim]`` at their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass
class DecodeBucket:
    start: int  # slice of the decode batch
    end: int
    num_blocks: int  # blocks gathered per sequence (the bucket's longest)
    block_ids: torch.Tensor  # [(end - start) * num_blocks]
    key_mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size] bool: True = attend


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[DecodeBucket]:
    lens = context_lens.tolist()
    blocks_needed = [(n + block_size - 1) // block_size for n in lens]
    buckets: list[DecodeBucket] = []
    start = 0
    while start < len(lens):
        end, low, high = start, blocks_needed[start], blocks_needed[start]
        while end < len(lens) and end - start < BUCKET_MAX_SEQS:
            nb = blocks_needed[end]
            new_low, new_high = min(low, nb), max(high, nb)
            if new_high - new_low > max(BUCKET_SLACK_BLOCKS, new_low // 4):
                break
            low, high, end = new_low, new_high, end + 1
        table = block_tables[start:end, :high]
        positions = torch.arange(high * block_size, device=context_lens.device)
        mask = positions[None, :] < context_lens[start:end, None]
        buckets.append(DecodeBucket(start, end, high, table.reshape(-1), mask[:, None, None, :]))
        start = end
    return buckets


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` of ``cache`` as rows ``[len(block_ids), block_size * kv_heads * head_dim]``."""
    flat = cache.view(cache.shape[0], -1)
    if out is None:
        return flat.index_select(0, block_ids)
    return torch.index_select(flat, 0, block_ids, out=out)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, buckets: list[DecodeBucket] | None = None,
                     workspace: Workspace | None = None) -> torch.Tensor:
    """One query token per sequence: ``q [num_seqs, heads, head_dim]`` -> same shape."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if buckets is None:
        buckets = plan_decode(block_tables, context_lens, block_size)
    out = torch.empty_like(q)
    for b in buckets:
        n, length = b.end - b.start, b.num_blocks * block_size
        k_rows = workspace.take(0, b.block_ids.numel(), k_cache) if workspace else None
        v_rows = workspace.take(1, b.block_ids.numel(), v_cache) if workspace else None
        k = _gather(k_cache, b.block_ids, k_rows).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        v = _gather(v_cache, b.block_ids, v_rows).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[b.start:b.end].unsqueeze(2), k, v, attn_mask=b.key_mask,
                                           scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[b.start:b.end] = o.squeeze(2)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    ``q [total_q, heads, head_dim]``; sequence ``s`` owns rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, which sit at the last positions of its
    ``context_lens[s]`` cached tokens (chunked prefill and prefix-cache hits).
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_heads = context_lens.numel(), q.shape[1]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    max_q = int(q_lens.max())
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    length = num_blocks * block_size
    table = block_tables[:, :num_blocks].reshape(-1)
    k = _gather(k_cache, table).view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather(v_cache, table).view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)

    # Scatter the ragged queries into [num_seqs, max_q] (a no-op view for one sequence).
    row = torch.arange(max_q, device=q.device)
    valid = row[None, :] < q_lens[:, None]  # [num_seqs, max_q]
    if num_seqs == 1:
        q_pad = q.unsqueeze(0)
    else:
        q_pad = q.new_zeros(num_seqs, max_q, num_heads, head_dim)
        q_pad[valid] = q
    query_pos = (context_lens - q_lens)[:, None] + row[None, :]  # absolute position of each query
    key_pos = torch.arange(length, device=q.device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    mask |= ~valid[:, :, None] & (key_pos == 0)  # padded query rows attend somewhere, and are dropped
    o = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    o = o.transpose(1, 2)
    return o[0] if num_seqs == 1 else o[valid]


class Workspace:
    """Reusable gather buffers: fresh multi-megabyte tensors cost page faults on every layer."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def take(self, slot: int, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        row = like[0].numel()
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < num_rows * row or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(num_rows * row * 3 // 2, 1 << 20), dtype=like.dtype, device=like.device)
            self._buffers[slot] = buf
        return buf[: num_rows * row].view(num_rows, row)
