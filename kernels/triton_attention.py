"""Triton paged-attention kernels: the GPU path (and, under ``TRITON_INTERPRET=1``, a CPU one).

Three kernels, each checked against ``reference``:

- ``write_kv``: copy this step's keys/values into their cache slots;
- ``decode``: one query token per sequence over its paged context, split-K
  over long contexts (partitions reduced by a second kernel);
- ``prefill``: causal varlen attention whose keys come from the paged cache,
  so chunked prefill and prefix-cache hits need nothing special.

KV caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``.  Scores are
kept in the log2 domain (``scale * log2(e)``, then ``exp2``), which is what the
hardware computes fastest; every sum is accumulated in fp32.

``TRITON_INTERPRET`` is read when ``@triton.jit`` runs, i.e. when this module is
first imported: set it before that to run the kernels on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedq.kernels.metadata import AttentionMetadata

LOG2E = math.log2(math.e)

DECODE_BLOCK_N = 64  # context tokens per inner-loop step, regardless of the cache's block size
DECODE_PARTITION = 512  # context tokens per split-K program, at most
DECODE_MIN_PARTITION = 256  # never split finer than this
PREFILL_BLOCK_M = 64  # query rows per program
PREFILL_BLOCK_N = 64  # keys per inner-loop step


# --------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src = token.to(tl.int64) * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = token.to(tl.int64) * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_pos
           + heads[:, None] * stride_cache_head + dims[None, :])
    k = tl.load(key_ptr + src, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_offsets(table_row_ptr, pos, valid, kv_head, stride_cache_block, stride_cache_pos, stride_cache_head,
                   BLOCK_SIZE: tl.constexpr):
    """Element offset of token ``pos`` (of one sequence, one kv head) inside the cache."""
    block_ids = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block_ids * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_pos + kv_head * stride_cache_head


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; UPCAST works around the interpreter's bf16 dot (see ``_launch_dot``)."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=PRECISION)
    return result


@triton.jit
def _decode_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale, partition_size, num_partitions,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table_seq,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One program: one sequence, one kv head (all its query heads), one context partition."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = part * partition_size
    if start >= context_len:  # this sequence is shorter than the longest one
        return
    end = tl.minimum(start + partition_size, context_len)

    rows = tl.arange(0, GROUP_PAD)  # padded up to what tl.dot accepts; extra rows are dropped
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    # -inf is safe: every tile of [start, end) holds at least one valid key.
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        offs = _paged_offsets(table_row, pos, valid, kv_head, stride_cache_block, stride_cache_pos,
                              stride_cache_head, BLOCK_SIZE)
        kv_mask = valid[:, None] & dim_mask[None, :]
        # Masked loads read 0, never the slot: stale or NaN cache contents must not leak in through 0 * NaN.
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    out = acc / l_i[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # Partials: [num_seqs, num_heads, num_partitions] (+ head_dim for the output).
        idx = (seq * NUM_HEADS + heads) * num_partitions + part
        tl.store(part_max_ptr + idx, m_i, mask=row_mask)
        tl.store(part_sum_ptr + idx, l_i, mask=row_mask)
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
    else:
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr,
    partition_size, num_partitions, stride_o_seq, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    """Combine a (sequence, head)'s partitions: weight each by its softmax mass."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    parts = tl.arange(0, PARTS_PAD)
    part_mask = parts < tl.cdiv(context_len, partition_size)  # partitions past the end were never written
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_DIM
    idx = (seq * NUM_HEADS + head) * num_partitions + parts
    m = tl.load(part_max_ptr + idx, mask=part_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + idx, mask=part_mask, other=0.0)  # noqa: E741
    o = tl.load(part_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :],
                mask=part_mask[:, None] & dim_mask[None, :], other=0.0)
    weight = tl.exp2(m - tl.max(m, 0)) * l
    out = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    qk_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_block, stride_cache_pos, stride_cache_head, stride_table_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One program: BLOCK_M query rows of one sequence, one query head."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:  # this sequence has fewer query rows than the longest
        return
    context_len = tl.load(context_lens_ptr + seq)
    kv_head = head // GROUP

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = context_len - q_len + rows  # the queries are the sequence's last q_len tokens
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    key_end = tl.minimum(context_len, context_len - q_len + (q_tile + 1) * BLOCK_M)  # causal: last row's keys
    # -inf is safe: the first tile holds key 0, which every row sees.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for tile in range(0, key_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < key_end
        offs = _paged_offsets(table_row, pos, valid, kv_head, stride_cache_block, stride_cache_pos,
                              stride_cache_head, BLOCK_SIZE)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


# --------------------------------------------------------------------------- launchers


def _pow2(n: int, at_least: int = 1) -> int:
    return max(triton.next_power_of_2(n), at_least)


def _launch_dot(dtype: torch.dtype) -> dict[str, object]:
    """The kernels' tl.dot settings for inputs of ``dtype``.

    fp32 would default to tf32 on GPUs (~1e-3 error); the 1e-5 contract needs full fp32.
    The interpreter (Triton 3.9) keeps bf16 as raw uint16 and multiplies those bits in
    tl.dot, so there bf16 operands are widened first; products of bf16 are exact in
    fp32, so this computes what the GPU's bf16 dot does.
    """
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "DOT_UPCAST": dtype == torch.bfloat16 and is_interpreted()}


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] "
                         "with the same strides")
    if k_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous")


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value [num_tokens, kv_heads, head_dim]`` at ``slot_mapping`` (negative = skip)."""
    _check_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value head_dim must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim), BLOCK_SIZE=block_size,
    )


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """Context tokens per program.  A partition covers the longest context unless that leaves the GPU
    idle: long contexts are cut into DECODE_PARTITION-token pieces, halved while there are fewer
    programs than two per multiprocessor (down to DECODE_MIN_PARTITION).  Contexts up to
    DECODE_PARTITION tokens always use one."""
    if max_context_len <= DECODE_PARTITION:
        return max(max_context_len, 1)
    size = DECODE_PARTITION
    while size > DECODE_MIN_PARTITION and num_seqs * num_kv_heads * triton.cdiv(max_context_len, size) < 2 * num_sms:
        size //= 2
    return size


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: more of them is only slower
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                            out: torch.Tensor | None = None, max_context_len: int | None = None,
                            partition_size: int | None = None) -> torch.Tensor:
    """One query token per sequence: ``q [num_seqs, heads, head_dim]`` -> same shape.

    ``max_context_len`` saves a device sync when the caller knows it; ``partition_size`` (context
    tokens per program) overrides the split-K choice of ``decode_partition_size``.
    """
    _check_cache(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_heads = q.shape[0], q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    assert q.stride(2) == 1, "q head_dim must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if partition_size is None:
        partition_size = decode_partition_size(num_seqs, num_kv_heads, max_context_len, _num_sms(q.device))
    num_partitions = triton.cdiv(max_context_len, partition_size)
    group = num_heads // num_kv_heads
    split = num_partitions > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused by the kernel
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, part_out, part_max, part_sum,
        q, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, partition_size, num_partitions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=_pow2(group, 16),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, SPLIT=split,
        **_launch_dot(q.dtype), num_warps=4,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, context_lens,
            partition_size, num_partitions, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim),
            PARTS_PAD=_pow2(num_partitions), num_warps=4,
        )
    return out


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                             scale: float, *, out: torch.Tensor | None = None,
                             max_q_len: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    Same contract as ``reference.prefill_attention``; ``max_q_len`` saves a device sync.
    """
    _check_cache(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads, num_seqs = q.shape[1], context_lens.numel()
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    assert q.stride(2) == 1, "q head_dim must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    grid = (num_seqs, triton.cdiv(max_q_len, PREFILL_BLOCK_M), num_heads)
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, **_launch_dot(q.dtype), num_warps=4,
    )
    return out


# --------------------------------------------------------------------------- backend


class TritonPagedAttention:
    """The GPU path; same interface as ``attention.TorchPagedAttention``.

    The host-side numbers the launches need (longest context, longest query run)
    are read once per engine step and kept in ``meta.plan``, not once per layer.
    """

    name = "triton"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        max_len = meta.plan.get("triton_decode_max_len")
        if max_len is None:
            max_len = int(meta.decode_context_lens.max()) if meta.num_decodes else 0
            meta.plan["triton_decode_max_len"] = max_len
        return decode_attention_triton(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                       scale, max_context_len=max_len)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        max_q = meta.plan.get("triton_prefill_max_q")
        if max_q is None:
            cu = meta.prefill_cu_seqlens_q
            max_q = int((cu[1:] - cu[:-1]).max()) if meta.num_prefills else 0
            meta.plan["triton_prefill_max_q"] = max_q
        return prefill_attention_triton(q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                        meta.prefill_block_tables, scale, max_q_len=max_q)


def is_interpreted() -> bool:
    """Whether this module's kernels were built for the CPU interpreter."""
    return type(_decode_kernel).__name__ == "InterpretedFunction"


__all__ = ["TritonPagedAttention", "decode_attention_triton", "decode_partition_size", "is_interpreted",
           "prefill_attention_triton", "write_kv_triton"]
