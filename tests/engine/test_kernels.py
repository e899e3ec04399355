"""Triton paged-attention kernels against the PyTorch reference (``kernels/reference.py``).

On the CPU the kernels run under ``TRITON_INTERPRET=1``.  With
``PAGEDQ_KERNEL_TEST_DEVICE=cuda`` the same checks run compiled on a GPU
(``scripts/gpu_check.sh`` does this).

The reference runs in float64 on the same inputs, so it is the exact answer to
within rounding.  Every kernel writes into NaN-filled outputs and reads caches
whose unused slots (block tails past a sequence's length, padding blocks) are
NaN too: an element a kernel forgets to write, or a slot it reads without
masking, shows up as NaN and fails the check.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedq.kernels import torch_attention as reference
from pagedq.kernels.attention import TorchPagedAttention, paged_attention
from pagedq.kernels.metadata import AttentionMetadata

DEVICE = os.environ.get("PAGEDQ_KERNEL_TEST_DEVICE", "cpu")
REPO = Path(__file__).resolve().parents[2]  # tests/engine/ -> the repository
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _load_kernels():
    """Import the kernels built for the interpreter on CPU, or compiled on a GPU.

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when the module is imported; if
    another test module imported the kernels without it, reload them.  The
    variable is set only for the import here and, below, while this module's
    tests run (Triton reads it again on the first launch), so it never leaks
    into other test modules.
    """
    if DEVICE != "cpu":
        return importlib.import_module("pagedq.kernels.triton_attention")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        module = importlib.import_module("pagedq.kernels.triton_attention")
        if not module.is_interpreted():
            module = importlib.reload(module)
    return module


ta = _load_kernels()

@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    if DEVICE != "cpu":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


# (query heads per kv head, kv heads): GQA ratios 1, 3 (SmolLM2: 9/3), 4, 8.
GROUPS = [(1, 2), (3, 3), (4, 2), (8, 1)]
SHAPES = [(group, kv_heads, head_dim, block_size) for group, kv_heads in GROUPS
          for head_dim in (64, 128) for block_size in (16, 32)]
SHAPE_IDS = [f"gqa{g}-kv{k}-d{d}-bs{b}" for g, k, d, b in SHAPES]


# --------------------------------------------------------------------------- helpers


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "output has unwritten (NaN) elements"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"


def make_paged(context_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Random caches and shuffled block tables for sequences of ``context_lens`` tokens.

    Returns the clean caches (for the reference), copies whose unused slots are
    NaN (for the kernel), the block table and the context lengths.  Block 0 is a
    padding block: table entries past a sequence's last block point at it.
    """
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(needed) + 3  # a few blocks nobody owns
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE).to(dtype)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(context_lens), max(needed) + 1, dtype=torch.int64)  # wider than needed, like the engine's
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, (n, nb) in enumerate(zip(context_lens, needed, strict=True)):
        blocks = [free.pop() for _ in range(nb)]
        table[s, :nb] = torch.tensor(blocks)
        for i in range(n):
            used[blocks[i // block_size], i % block_size] = True
    unused = ~used.to(DEVICE)
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    k_poisoned[unused] = float("nan")
    v_poisoned[unused] = float("nan")
    lens = torch.tensor(context_lens, dtype=torch.int64, device=DEVICE)
    return k_cache, v_cache, k_poisoned, v_poisoned, table.to(DEVICE), lens


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def decode_ref(q, k_cache, v_cache, table, lens, scale) -> torch.Tensor:
    return reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), table, lens, scale)


def prefill_ref(q, k_cache, v_cache, cu, lens, table, scale) -> torch.Tensor:
    return reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, lens, table, scale)


# --------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(3, 64, 16), (1, 128, 32), (2, 128, 16)])
def test_write_kv_stores_exactly_the_given_slots(dtype, kv_heads, head_dim, block_size):
    num_blocks, num_tokens = 6, 37
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    v_cache = k_cache.clone()
    # Key and value as views into one fused projection output, as a model produces them.
    fused = torch.randn(num_tokens, 2 * kv_heads + 1, head_dim, device=DEVICE).to(dtype)
    key, value = fused[:, :kv_heads], fused[:, kv_heads:2 * kv_heads]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]

    ta.write_kv_triton(key, value, k_cache, v_cache, slots)

    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()

    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv(key, value, ref_k, ref_v, slots)
    assert torch.equal(ref_k.view(-1, kv_heads, head_dim)[slots], flat_k[slots])


def test_write_kv_skips_negative_slots():
    k_cache = torch.full((2, 16, 1, 64), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    key, value = torch.randn(2, 2, 1, 64, device=DEVICE).unbind(0)
    ta.write_kv_triton(key, value, k_cache, v_cache, torch.tensor([5, -1], device=DEVICE))
    assert torch.equal(k_cache.view(-1, 1, 64)[5], key[0])
    assert k_cache.isnan().sum() == k_cache.numel() - 64 and v_cache.isnan().sum() == v_cache.numel() - 64


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "split-k"])
@pytest.mark.parametrize("group,kv_heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference_fp32(group, kv_heads, head_dim, block_size, split):
    lens = [1, 19, 50, 133]  # none a multiple of 16 or 32; 133 spans 3 inner tiles (and 3 partitions of 64)
    k, v, k_bad, v_bad, table, context_lens = make_paged(lens, block_size, kv_heads, head_dim, torch.float32)
    q = torch.randn(len(lens), group * kv_heads, head_dim, device=DEVICE)
    scale = head_dim ** -0.5
    out = nan_like(q)
    ta.decode_attention_triton(q, k_bad, v_bad, table, context_lens, scale, out=out,
                               partition_size=64 if split else None)
    check_close(out, decode_ref(q, k, v, table, context_lens, scale), torch.float32)


def test_decode_splits_long_contexts_on_its_own():
    lens = [700, 33, 515]  # > DECODE_PARTITION: the automatic choice splits
    assert ta.decode_partition_size(len(lens), 3, max(lens), num_sms=1) < max(lens)
    k, v, k_bad, v_bad, table, context_lens = make_paged(lens, 16, 3, 64, torch.float32)
    q = torch.randn(len(lens), 9, 64, device=DEVICE)
    out = ta.decode_attention_triton(q, k_bad, v_bad, table, context_lens, 0.125, out=nan_like(q))
    check_close(out, decode_ref(q, k, v, table, context_lens, 0.125), torch.float32)


def test_decode_partition_choice():
    assert ta.decode_partition_size(1, 8, 300, num_sms=132) == 300  # short: one partition
    assert ta.decode_partition_size(256, 8, 8192, num_sms=132) == ta.DECODE_PARTITION
    small_batch = ta.decode_partition_size(1, 8, 8192, num_sms=132)  # few programs: cut finer
    assert ta.DECODE_MIN_PARTITION <= small_batch < ta.DECODE_PARTITION


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,kv_heads,head_dim,block_size", [(3, 3, 64, 16), (4, 2, 128, 32)])
def test_decode_half_precision(dtype, group, kv_heads, head_dim, block_size):
    lens = [7, 90, 45]
    k, v, k_bad, v_bad, table, context_lens = make_paged(lens, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), group * kv_heads, head_dim, device=DEVICE).to(dtype)
    out = ta.decode_attention_triton(q, k_bad, v_bad, table, context_lens, head_dim ** -0.5, out=nan_like(q),
                                     partition_size=64)
    assert out.dtype == dtype
    check_close(out, decode_ref(q, k, v, table, context_lens, head_dim ** -0.5), dtype)


# --------------------------------------------------------------------------- prefill

# (q_len, context_len): a fresh prompt over two query tiles, a chunk after a
# cached prefix (chunked prefill / prefix hit), a one-token chunk, a short prompt.
PREFILL_SEQS = [(70, 70), (23, 100), (1, 37), (5, 5)]


def _prefill_case(seqs, block_size, kv_heads, group, head_dim, dtype):
    q_lens, lens = zip(*seqs, strict=True)
    k, v, k_bad, v_bad, table, context_lens = make_paged(list(lens), block_size, kv_heads, head_dim, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64, device=DEVICE)
    q = torch.randn(int(cu[-1]), group * kv_heads, head_dim, device=DEVICE).to(dtype)
    return q, k, v, k_bad, v_bad, table, context_lens, cu


@pytest.mark.parametrize("group,kv_heads,head_dim,block_size", SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_reference_fp32(group, kv_heads, head_dim, block_size):
    q, k, v, k_bad, v_bad, table, lens, cu = _prefill_case(PREFILL_SEQS, block_size, kv_heads, group, head_dim,
                                                           torch.float32)
    scale = head_dim ** -0.5
    out = nan_like(q)
    ta.prefill_attention_triton(q, k_bad, v_bad, cu, lens, table, scale, out=out)
    check_close(out, prefill_ref(q, k, v, cu, lens, table, scale), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,kv_heads,head_dim,block_size", [(3, 3, 64, 16), (4, 2, 128, 32)])
def test_prefill_half_precision(dtype, group, kv_heads, head_dim, block_size):
    q, k, v, k_bad, v_bad, table, lens, cu = _prefill_case(PREFILL_SEQS, block_size, kv_heads, group, head_dim,
                                                           dtype)
    out = ta.prefill_attention_triton(q, k_bad, v_bad, cu, lens, table, head_dim ** -0.5, out=nan_like(q))
    assert out.dtype == dtype
    check_close(out, prefill_ref(q, k, v, cu, lens, table, head_dim ** -0.5), dtype)


# --------------------------------------------------------------------------- backend


def test_backend_matches_torch_backend_on_a_mixed_step():
    """Two decodes and two prefill chunks in one step, through ``paged_attention``."""
    block_size, kv_heads, group, head_dim = 16, 3, 3, 64
    decode_lens, prefill = [40, 17], [(30, 30), (12, 60)]
    lens = decode_lens + [n for _, n in prefill]
    k_cache, v_cache, *_, table, context_lens = make_paged(lens, block_size, kv_heads, head_dim, torch.float32)
    q_lens = [1, 1] + [q for q, _ in prefill]
    # The new tokens are each sequence's last q_len positions.
    slots = [int(table[s, p // block_size]) * block_size + p % block_size
             for s, (n, ql) in enumerate(zip(lens, q_lens, strict=True)) for p in range(n - ql, n)]
    num_tokens = sum(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), num_decode_tokens=2,
        decode_block_tables=table[:2], decode_context_lens=context_lens[:2],
        prefill_cu_seqlens_q=torch.tensor([0, 30, 42], device=DEVICE), prefill_context_lens=context_lens[2:],
        prefill_block_tables=table[2:])
    q = torch.randn(num_tokens, group * kv_heads, head_dim, device=DEVICE)
    key, value = torch.randn(2, num_tokens, kv_heads, head_dim, device=DEVICE).unbind(0)

    caches = {}
    outs = {}
    for backend in (TorchPagedAttention(), ta.TritonPagedAttention()):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[backend.name] = paged_attention(backend, q, key, value, kc, vc, meta, head_dim ** -0.5)
        caches[backend.name] = (kc, vc)
        meta.plan.clear()
    assert torch.equal(caches["torch"][0], caches["triton"][0])
    assert torch.equal(caches["torch"][1], caches["triton"][1])
    check_close(outs["triton"], outs["torch"], torch.float32)


# --------------------------------------------------------------------------- bench script


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU run times the kernels itself")
def test_bench_dry_run():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_kernels.py"), "--dry-run"],
                            capture_output=True, text=True, timeout=150, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "correctness: all" in result.stdout and "checks passed" in result.stdout
