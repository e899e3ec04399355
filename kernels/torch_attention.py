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
    key_mask: torch.Tensor  # [end - start, 1, 1, num_blocks * block_size] additive: 0 = attend, -inf = not


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere: built once per step, not converted in every layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                dtype: torch.dtype = torch.float32, window: int | None = None) -> list[DecodeBucket]:
    """Buckets of similar-length sequences; ``window``: attend to the last ``window`` positions only."""
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
        allowed = positions[None, :] < context_lens[start:end, None]
        if window is not None:  # the query sits at context_len - 1; keys older than window - 1 drop out
            allowed &= positions[None, :] > context_lens[start:end, None] - 1 - window
        mask = additive_mask(allowed, dtype)
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
                     workspace: Workspace | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: ``q [num_seqs, heads, head_dim]`` -> same shape."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if buckets is None:
        buckets = plan_decode(block_tables, context_lens, block_size, q.dtype)
    out = torch.empty_like(q)
    for b in buckets:
        n, length = b.end - b.start, b.num_blocks * block_size
        k_rows = workspace.take(0, b.block_ids.numel(), k_cache) if workspace else None
        v_rows = workspace.take(1, b.block_ids.numel(), v_cache) if workspace else None
        k = _gather(k_cache, b.block_ids, k_rows).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        v = _gather(v_cache, b.block_ids, v_rows).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        # The query heads sharing a KV head become that head's "query rows": each K/V block is read once.
        q_groups = q[b.start:b.end].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if softcap is None:
            o = F.scaled_dot_product_attention(q_groups, k, v, attn_mask=b.key_mask, scale=scale)
        else:
            o = softcapped_attention(q_groups.unsqueeze(3), k, v, b.key_mask.unsqueeze(1), scale, softcap).squeeze(3)
        out[b.start:b.end] = o.reshape(n, num_heads, head_dim)
    return out


@dataclass
class PrefillBucket:
    first: int  # sequences first..last-1, whose query rows are q_start..q_end-1
    last: int
    q_start: int
    q_end: int
    max_q: int
    block_ids: torch.Tensor  # [(last - first) * num_blocks]
    mask: torch.Tensor  # [last - first, 1, max_q, num_blocks * block_size] additive
    valid: torch.Tensor | None  # [last - first, max_q] bool: real (not padding) query rows; None for one sequence


def plan_prefill(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                 block_size: int, dtype: torch.dtype = torch.float32, window: int | None = None) -> list[PrefillBucket]:
    """Group neighbouring sequences whose padded [queries x keys] stays close to their real size."""
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    q_lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    buckets: list[PrefillBucket] = []
    first = 0
    while first < len(ctx):
        last, real = first + 1, q_lens[first] * ctx[first]
        while last < len(ctx):
            n, grown = last + 1 - first, real + q_lens[last] * ctx[last]
            if n * max(q_lens[first:last + 1]) * max(ctx[first:last + 1]) > 1.25 * grown + 4096:
                break
            last, real = last + 1, grown
        buckets.append(_prefill_bucket(first, last, cu, q_lens, ctx, block_tables, block_size, dtype,
                                       context_lens.device, window))
        first = last
    return buckets


def _prefill_bucket(first, last, cu, q_lens, ctx, block_tables, block_size, dtype, device,
                    window: int | None = None) -> PrefillBucket:
    lens_q = torch.tensor(q_lens[first:last], device=device)
    lens_k = torch.tensor(ctx[first:last], device=device)
    max_q, num_blocks = max(q_lens[first:last]), -(-max(ctx[first:last]) // block_size)
    row = torch.arange(max_q, device=device)
    valid = row[None, :] < lens_q[:, None]  # [n, max_q]
    query_pos = (lens_k - lens_q)[:, None] + row[None, :]  # absolute position of each query
    key_pos = torch.arange(num_blocks * block_size, device=device)
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > query_pos[:, :, None] - window
    allowed |= ~valid[:, :, None] & (key_pos == 0)  # padded query rows attend somewhere, and are dropped
    return PrefillBucket(first, last, cu[first], cu[last], max_q,
                         block_tables[first:last, :num_blocks].reshape(-1),
                         additive_mask(allowed, dtype)[:, None], valid if last - first > 1 else None)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, buckets: list[PrefillBucket] | None = None,
                      workspace: Workspace | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    ``q [total_q, heads, head_dim]``; sequence ``s`` owns rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, which sit at the last positions of its
    ``context_lens[s]`` cached tokens (chunked prefill and prefix-cache hits).
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if buckets is None:
        buckets = plan_prefill(cu_seqlens_q, context_lens, block_tables, block_size, q.dtype)
    out = torch.empty_like(q)
    for b in buckets:
        n, length = b.last - b.first, b.mask.shape[-1]
        k_rows = workspace.take(0, b.block_ids.numel(), k_cache) if workspace else None
        v_rows = workspace.take(1, b.block_ids.numel(), v_cache) if workspace else None
        k = _gather(k_cache, b.block_ids, k_rows).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        v = _gather(v_cache, b.block_ids, v_rows).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        rows = q[b.q_start:b.q_end]
        if b.valid is None:
            q_pad = rows.unsqueeze(0)
        else:  # scatter the ragged queries into [n, max_q]
            q_pad = q.new_zeros(n, b.max_q, num_heads, head_dim)
            q_pad[b.valid] = rows
        if softcap is None:
            o = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=b.mask, scale=scale,
                                               enable_gqa=num_heads != num_kv_heads).transpose(1, 2)
        else:
            groups = q_pad.reshape(n, b.max_q, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(0, 2, 3, 1, 4)
            o = softcapped_attention(groups, k, v, b.mask.unsqueeze(1), scale, softcap)
            o = o.reshape(n, num_heads, b.max_q, head_dim).transpose(1, 2)
        out[b.q_start:b.q_end] = o[0] if b.valid is None else o[b.valid]
    return out


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's ``tanh(scores / cap) * cap`` on the scores, which SDPA cannot apply.

    ``q [n, kv_heads, group, q_len, d]``, ``k``/``v [n, kv_heads, keys, d]``, ``mask`` additive, broadcast to
    ``[n, kv_heads, group, q_len, keys]``.  The operations follow transformers' eager attention.
    """
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2))


class Workspace:
    """Reusable gather buffers: fresh multi-megabyte tensors cost page faults on every layer."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def take(self, slot: int, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        row = like.stride(0)
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < num_rows * row or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(num_rows * row * 3 // 2, 1 << 20), dtype=like.dtype, device=like.device)
            self._buffers[slot] = buf
        return buf[: num_rows * row].view(num_rows, row)
