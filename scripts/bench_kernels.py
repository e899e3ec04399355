"""Check, then time, the Triton paged-attention kernels against the PyTorch reference and SDPA.

    python scripts/bench_kernels.py [--out bench.md]   # on a GPU: correctness, then timings (~1-2 min)
    python scripts/bench_kernels.py --dry-run           # on the CPU: interpreter, tiny sizes, correctness only

Each kernel is first compared with ``kernels/reference.py`` computed in float64
(relative error <= 1e-5 in fp32, <= 1e-2 in fp16/bf16); any failure stops the
run before timing.  Timings are medians from ``triton.testing.do_bench``.  For
every shape the reference path (what the engine runs without Triton) and
``scaled_dot_product_attention`` on already gathered, contiguous KV (the best a
dense kernel can do, gathering not counted) are timed side by side.  Decode and
write_kv are memory-bound, so their column is achieved bandwidth (KV read, q and
output, or the K/V copy) as a fraction of a device-to-device copy measured at
the start; prefill is compute-bound and reports TFLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq.kernels import torch_attention as reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class Model:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


LLAMA_8B = Model("d128 32/8", 32, 8, 128)  # Llama-3-8B's attention shape
SMOLLM2 = Model("d64 9/3", 9, 3, 64)  # the default model (GQA group of 3)


@functools.cache
def kernels():
    """The Triton module, imported only after ``--dry-run`` has chosen the interpreter."""
    return importlib.import_module("pagedq.kernels.triton_attention")


# --------------------------------------------------------------------------- inputs


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def paged_batch(lens: list[int], model: Model, dtype: torch.dtype, device: str, block_size: int = 16) -> Paged:
    """Random caches holding sequences of ``lens`` tokens in shuffled blocks."""
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 1
    shape = (num_blocks, block_size, model.kv_heads, model.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, device=device)
    table = torch.zeros(len(lens), max(needed), dtype=torch.int64, device=device)
    start = 0
    for s, nb in enumerate(needed):
        table[s, :nb] = order[start:start + nb]
        start += nb
    return Paged(k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int64, device=device))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# --------------------------------------------------------------------------- correctness


def check_write_kv(model: Model, dtype: torch.dtype, device: str, num_tokens: int) -> float:
    p = paged_batch([num_tokens + 5], model, dtype, device)
    key = torch.randn(num_tokens, model.kv_heads, model.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(p.k_cache.shape[0] * p.k_cache.shape[1], device=device)[:num_tokens]
    k_ref, v_ref = p.k_cache.clone(), p.v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    kernels().write_kv_triton(key, value, p.k_cache, p.v_cache, slots)
    exact = torch.equal(k_ref, p.k_cache) and torch.equal(v_ref, p.v_cache)
    return 0.0 if exact else float("inf")


def check_decode(model: Model, dtype: torch.dtype, device: str, lens: list[int], split: bool) -> float:
    p = paged_batch(lens, model, dtype, device)
    q = torch.randn(len(lens), model.heads, model.head_dim, dtype=dtype, device=device)
    scale = model.head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels().decode_attention_triton(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, scale, out=out,
                                      partition_size=128 if split else None)
    ref = reference.decode_attention(q.double(), p.k_cache.double(), p.v_cache.double(), p.block_tables,
                                     p.context_lens, scale)
    return rel_err(out, ref)


def check_prefill(model: Model, dtype: torch.dtype, device: str, seqs: list[tuple[int, int]]) -> float:
    """``seqs``: (q_len, context_len) per sequence; context_len > q_len is a chunk after cached tokens."""
    p = paged_batch([n for _, n in seqs], model, dtype, device)
    q_lens = torch.tensor([q for q, _ in seqs], device=device)
    cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0))
    q = torch.randn(int(cu[-1]), model.heads, model.head_dim, dtype=dtype, device=device)
    scale = model.head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernels().prefill_attention_triton(q, p.k_cache, p.v_cache, cu, p.context_lens, p.block_tables, scale,
                                       out=out)
    ref = reference.prefill_attention(q.double(), p.k_cache.double(), p.v_cache.double(), cu, p.context_lens,
                                      p.block_tables, scale)
    return rel_err(out, ref)


def run_checks(device: str, tiny: bool) -> bool:
    if tiny:
        plan = [(SMOLLM2, torch.float32), (LLAMA_8B, torch.bfloat16)]
        decode_lens, prefill_seqs, tokens = [5, 40, 77], [(20, 20), (7, 50)], 9
    else:
        plan = [(m, dt) for m in (LLAMA_8B, SMOLLM2) for dt in (torch.float32, torch.bfloat16, torch.float16)]
        decode_lens, prefill_seqs, tokens = [1, 77, 700, 3001], [(300, 300), (77, 1000), (1, 33)], 1000
    results = []
    for model, dtype in plan:
        name = f"{model.name} {DTYPE_NAMES[dtype]}"
        results.append((f"write_kv {name}", check_write_kv(model, dtype, device, tokens), 0.0))
        for split in (False, True):
            err = check_decode(model, dtype, device, decode_lens, split)
            results.append((f"decode{' split-k' if split else ''} {name}", err, TOLERANCE[dtype]))
        results.append((f"prefill {name}", check_prefill(model, dtype, device, prefill_seqs), TOLERANCE[dtype]))
    failed = 0
    for label, err, tol in results:
        ok = err <= tol  # NaN (an unwritten output) fails too
        failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {label:32s} rel err {err:.2e} (limit {tol:.0e})")
    if failed:
        print(f"correctness: {failed} of {len(results)} checks FAILED")
        return False
    print(f"correctness: all {len(results)} checks passed")
    return True


# --------------------------------------------------------------------------- timing


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy, counting what is read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)


@dataclass
class Row:
    kernel: str
    model: str
    dtype: str
    shape: str
    triton_ms: float
    reference_ms: float
    sdpa_ms: float | None = None
    triton_1part_ms: float | None = None
    gbytes: float | None = None  # moved by the kernel: for bandwidth
    tflop: float | None = None  # for prefill


def timed(fn) -> float | None:
    try:
        return bench_ms(fn)
    except Exception as exc:  # a baseline may lack a kernel for this shape; keep the run going
        print(f"    ({type(exc).__name__}: {str(exc)[:120]})")
        return None


def bench_write_kv(model: Model, dtype: torch.dtype, num_tokens: int, device: str = "cuda") -> Row:
    p = paged_batch([num_tokens], model, dtype, device)
    key = torch.randn(num_tokens, model.kv_heads, model.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(p.k_cache.shape[0] * p.k_cache.shape[1], device=device)[:num_tokens]
    args = (key, value, p.k_cache, p.v_cache, slots)
    return Row("write_kv", model.name, DTYPE_NAMES[dtype], f"{num_tokens} tokens",
               bench_ms(lambda: kernels().write_kv_triton(*args)), bench_ms(lambda: reference.write_kv(*args)),
               gbytes=4 * key.numel() * key.element_size() / 1e9)


def bench_decode(model: Model, dtype: torch.dtype, batch: int, context: int, device: str = "cuda") -> Row:
    p = paged_batch([context] * batch, model, dtype, device)
    q = torch.randn(batch, model.heads, model.head_dim, dtype=dtype, device=device)
    scale = model.head_dim ** -0.5
    ta = kernels()
    args = (q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, scale)
    triton_ms = bench_ms(lambda: ta.decode_attention_triton(*args, max_context_len=context))
    one_part_ms = bench_ms(lambda: ta.decode_attention_triton(*args, max_context_len=context,
                                                              partition_size=context))
    buckets = reference.plan_decode(p.block_tables, p.context_lens, p.k_cache.shape[1])  # once per step
    workspace = reference.Workspace()
    reference_ms = timed(lambda: reference.decode_attention(*args, buckets, workspace))

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[p.block_tables.reshape(-1)]
        return rows.view(batch, -1, model.kv_heads, model.head_dim)[:, :context].transpose(1, 2).contiguous()

    k, v = gathered(p.k_cache), gathered(p.v_cache)
    sdpa_ms = timed(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                                           enable_gqa=model.heads != model.kv_heads))
    kv_bytes = 2 * batch * context * model.kv_heads * model.head_dim * q.element_size()
    return Row("decode", model.name, DTYPE_NAMES[dtype], f"batch {batch} x ctx {context}", triton_ms,
               reference_ms, sdpa_ms, one_part_ms, gbytes=(kv_bytes + 2 * q.numel() * q.element_size()) / 1e9)


def bench_prefill(model: Model, dtype: torch.dtype, num_seqs: int, q_len: int, context: int,
                  device: str = "cuda") -> Row:
    p = paged_batch([context] * num_seqs, model, dtype, device)
    q = torch.randn(num_seqs * q_len, model.heads, model.head_dim, dtype=dtype, device=device)
    cu = torch.arange(0, num_seqs + 1, device=device) * q_len
    scale = model.head_dim ** -0.5
    args = (q, p.k_cache, p.v_cache, cu, p.context_lens, p.block_tables, scale)
    triton_ms = bench_ms(lambda: kernels().prefill_attention_triton(*args, max_q_len=q_len))
    reference_ms = timed(lambda: reference.prefill_attention(*args))

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[p.block_tables.reshape(-1)]
        return rows.view(num_seqs, -1, model.kv_heads, model.head_dim)[:, :context].transpose(1, 2).contiguous()

    k, v = gathered(p.k_cache), gathered(p.v_cache)
    qd = q.view(num_seqs, q_len, model.heads, model.head_dim).transpose(1, 2)
    gqa = model.heads != model.kv_heads
    if q_len == context:
        sdpa_ms = timed(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=gqa))
    else:
        rows = torch.arange(q_len, device=device)[:, None] + context - q_len
        mask = torch.arange(context, device=device)[None, :] <= rows
        sdpa_ms = timed(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=gqa))
    pairs = q_len * (context - q_len) + q_len * (q_len + 1) // 2  # (query, key) pairs each sequence attends
    tflop = 4 * pairs * num_seqs * model.heads * model.head_dim / 1e12
    shape = f"{num_seqs} x q {q_len}" + (f" (ctx {context})" if context != q_len else "")
    return Row("prefill", model.name, DTYPE_NAMES[dtype], shape, triton_ms, reference_ms, sdpa_ms, tflop=tflop)


def run_timings(quick: bool) -> list[Row]:
    configs = [(LLAMA_8B, torch.bfloat16), (LLAMA_8B, torch.float16), (SMOLLM2, torch.bfloat16)]
    batches, contexts = ([1, 64], [512, 8192]) if quick else ([1, 16, 64, 256], [512, 2048, 8192])
    prefills = [(1, 2048, 2048), (4, 1024, 1024), (8, 256, 2304), (16, 512, 512)]
    rows = []
    for model, dtype in configs:
        for tokens in (256, 8192):
            rows.append(bench_write_kv(model, dtype, tokens))
        for batch in batches:
            for context in contexts:
                rows.append(bench_decode(model, dtype, batch, context))
                print(f"  {rows[-1].kernel} {model.name} {DTYPE_NAMES[dtype]} {rows[-1].shape}: "
                      f"{rows[-1].triton_ms * 1e3:.1f} us", flush=True)
        for seqs in prefills[:2] if quick else prefills:
            rows.append(bench_prefill(model, dtype, *seqs))
        torch.cuda.empty_cache()
    return rows


def fmt_us(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms * 1e3:.1f}"


def fmt_ratio(other_ms: float | None, triton_ms: float) -> str:
    return "n/a" if other_ms is None else f"{other_ms / triton_ms:.2f}x"


def markdown(rows: list[Row], copy_bw: float) -> str:
    lines = [
        f"Copy bandwidth (device-to-device, read + write): {copy_bw / 1e12:.2f} TB/s",
        "",
        "| kernel | model | dtype | shape | triton us | triton 1-partition us | reference us | sdpa us "
        "| speedup vs ref | vs sdpa | triton throughput |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.tflop is not None:
            throughput = f"{r.tflop / (r.triton_ms * 1e-3):.0f} TFLOP/s"
        else:
            bw = r.gbytes * 1e9 / (r.triton_ms * 1e-3)
            throughput = f"{bw / 1e12:.2f} TB/s ({100 * bw / copy_bw:.0f}% of copy)"
        lines.append(f"| {r.kernel} | {r.model} | {r.dtype} | {r.shape} | {fmt_us(r.triton_ms)} "
                     f"| {fmt_us(r.triton_1part_ms) if r.triton_1part_ms else '-'} | {fmt_us(r.reference_ms)} "
                     f"| {fmt_us(r.sdpa_ms) if r.kernel != 'write_kv' else '-'} "
                     f"| {fmt_ratio(r.reference_ms, r.triton_ms)} "
                     f"| {fmt_ratio(r.sdpa_ms, r.triton_ms) if r.kernel != 'write_kv' else '-'} | {throughput} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes, correctness only")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported: @triton.jit reads it
        return 0 if run_checks("cpu", tiny=True) else 1
    if not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU interpreter check", file=sys.stderr)
        return 2

    import triton

    device_name = torch.cuda.get_device_name()
    print(f"device: {device_name}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.perf_counter()
    if not run_checks("cuda", tiny=False):
        return 1
    copy_bw = copy_bandwidth("cuda")
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s")
    rows = run_timings(args.quick)
    table = (f"{device_name}, torch {torch.__version__}, triton {triton.__version__}, block size 16, "
             f"median of triton.testing.do_bench\n\n" + markdown(rows, copy_bw))
    print()
    print(table)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
