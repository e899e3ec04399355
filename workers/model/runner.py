"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

``LocalExecutor`` is the engine's executor when the whole model lives in this process.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections import deque
from dataclasses import dataclass, field

import torch

from pagedq.kernels import AttentionMetadata
from pagedq.workers.engine.executor import SamplerOutput, StepResult
from pagedq.workers.engine.scheduler import SchedulerOutput
from pagedq.workers.engine.sequence import Sequence
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.decoder import DecoderModel
from pagedq.workers.model.prompt_logprobs import plan_spans, score_spans
from pagedq.workers.model.sampler import sample

log = logging.getLogger(__name__)


def keep_freed_memory() -> None:
    """Stop glibc from returning freed buffers to the OS after every step.

    Each layer allocates multi-megabyte temporaries; served from fresh pages they
    cost a page fault per 4 KiB, which on a 2-core machine is a visible slice
    of a decode step.  Raising the mmap and trim thresholds keeps them reusable.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: the glibc maximum
            libc.mallopt(-1, 1 << 34)  # M_TRIM_THRESHOLD
        except OSError:
            pass


def kv_cache_block_bytes(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype,
                         num_kv_heads: int | None = None) -> int:
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * num_layers * block_size * heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]  # the driver's sequences for those rows (empty on other stages)
    packed: torch.Tensor  # int64: all of the above but the sequences, what other stages receive
    prompt_spans: list = field(default_factory=list)  # prompt tokens scored this step (``prompt_logprobs``)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


_HEADER = 7  # num_tokens, num_decodes, decode table width, num_prefills, prefill table width, num_sampled, KV groups - 1


def step_order(sched: SchedulerOutput) -> list[tuple[Sequence, int]]:
    """The scheduled (sequence, tokens) in the order of the step's rows (``pack_step``)."""
    by_context = sorted(sched.scheduled, key=lambda x: x[0].num_computed_tokens + x[1])
    return [(s, n) for s, n in by_context if n == 1] + [(s, n) for s, n in by_context if n > 1]


def _group_part(rows: list[tuple[Sequence, int]], group: int, bs: int, widths: tuple[int, int],
                num_decodes: int) -> list[int]:
    """One KV group's cache slots for the step's new tokens, then its decode and prefill block tables (padded)."""
    slots: list[int] = []
    for seq, n in rows:
        table, start = seq.block_tables[group], seq.num_computed_tokens
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
    flat: list[int] = []
    for i, (seq, _) in enumerate(rows):
        table = seq.block_tables[group]
        if table and table[0] < 0:  # a sliding group's freed head (NULL_BLOCK): any block will do, masked out
            table = [max(b, 0) for b in table]
        flat += table
        flat += [0] * (widths[i >= num_decodes] - len(table))
    return slots + flat


def pack_step(sched: SchedulerOutput, block_size: int) -> tuple[list[int], list[Sequence]]:
    """Flatten a scheduled step into one list of ints (layout: ``unpack_step``) and the sampled sequences.

    Decodes come first, then prefill chunks; each group shortest context first
    (the CPU attention path batches neighbours of similar length together).
    """
    ordered = step_order(sched)
    decodes = [(s, n) for s, n in ordered if n == 1]
    prefills = [(s, n) for s, n in ordered if n > 1]
    rows = decodes + prefills
    input_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    for seq, n in rows:
        start = seq.num_computed_tokens
        input_ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        if start + n == seq.num_tokens:  # every known token computed: next token is due
            sample_rows.append(len(input_ids) - 1)
            sample_seqs.append(seq)
    widths = (max((len(s.block_table) for s, _ in decodes), default=0),
              max((len(s.block_table) for s, _ in prefills), default=0))
    num_groups = len(rows[0][0].block_tables) if rows else 1
    groups = [_group_part(rows, g, block_size, widths, len(decodes)) for g in range(num_groups)]
    n, nd = len(input_ids), len(decodes)
    slots, dec_tables, pre_tables = groups[0][:n], groups[0][n:n + nd * widths[0]], groups[0][n + nd * widths[0]:]
    cu_q = [0]
    for _, k in prefills:
        cu_q.append(cu_q[-1] + k)
    header = [n, nd, widths[0], len(prefills), widths[1], len(sample_rows), num_groups - 1]
    packed = (header + input_ids + positions + slots + dec_tables
              + [s.num_computed_tokens + k for s, k in decodes] + cu_q
              + [s.num_computed_tokens + k for s, k in prefills] + pre_tables + sample_rows)
    for part in groups[1:]:
        packed += part
    return packed, sample_seqs


def unpack_step(packed: torch.Tensor, sample_seqs: list[Sequence] | None = None,
                header: list[int] | None = None) -> StepInputs:
    """Views into ``packed`` (on the device the model runs on) as the model's inputs."""
    n, nd, dw, npf, pw, ns, extra = header or packed[:_HEADER].tolist()
    sizes = [n, n, n, nd * dw, nd, npf + 1, npf, npf * pw, ns] + [n, nd * dw, npf * pw] * extra
    ids, positions, slots, dec_tables, dec_lens, cu_q, pre_lens, pre_tables, rows, *rest = (
        packed[_HEADER:].split(sizes))

    def meta(slots: torch.Tensor, dec_tables: torch.Tensor, pre_tables: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=nd, decode_block_tables=dec_tables.view(nd, dw),
            decode_context_lens=dec_lens, prefill_cu_seqlens_q=cu_q, prefill_context_lens=pre_lens,
            prefill_block_tables=pre_tables.view(npf, pw))

    first = meta(slots, dec_tables, pre_tables)
    first.groups = [meta(*rest[i:i + 3]) for i in range(0, len(rest), 3)]
    return StepInputs(ids, positions, first, rows, sample_seqs or [], packed)


class ModelRunner:
    """One process's part of the model and its KV cache: all layers, or one stage's (or shard's)."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        keep_freed_memory()
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, model.num_kv_heads, model.cfg.head_dim)
        # Zeroed, not empty: attention masks the unused slots of a gathered block, but a NaN left
        # there by recycled memory still poisons the output (0 * NaN).
        slots, num_slots = model.cache_layout(model.cfg).stage_slots(model.first, model.last)
        tensors = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(num_slots)]
        self.kv_caches = [tensors[slot] for slot in slots]  # per layer; layers of different KV groups share one

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        packed, sample_seqs = pack_step(sched, self.block_size)
        inputs = unpack_step(torch.tensor(packed, dtype=torch.long).to(self.device), sample_seqs, packed[:_HEADER])
        inputs.prompt_spans = plan_spans(step_order(sched))
        return inputs

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This process's layers over the step; the first stage embeds, later ones continue ``hidden``."""
        if hidden is None:
            hidden = self.model.embed_tokens(inputs.input_ids)
        return self.model.forward(hidden, inputs.positions, inputs.meta, self.kv_caches)

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, inputs: StepInputs, seqs: list[Sequence]) -> SamplerOutput:
        out = sample(self.model.compute_logits(hidden[inputs.sample_rows]), seqs) if seqs else SamplerOutput([], [])
        out.prompt_logprobs = score_spans(self.model.compute_logits, hidden, inputs.prompt_spans)
        return out

    def execute(self, sched: SchedulerOutput) -> tuple[list[Sequence], SamplerOutput]:
        """One forward pass over the scheduled tokens; samples for sequences whose prompt is done."""
        inputs = self.prepare(sched)
        hidden = self.forward(inputs)
        return inputs.sample_seqs, self.sample(hidden, inputs, inputs.sample_seqs)


class LocalExecutor:
    """The whole model in this process: a step runs when it is submitted (an ``Executor``)."""

    max_inflight = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._done: deque[StepResult] = deque()

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def num_inflight(self) -> int:
        return len(self._done)

    def submit(self, sched: SchedulerOutput) -> None:
        seqs, sampled = self.runner.execute(sched)
        self._done.append(StepResult(sched, seqs, sampled))

    def collect(self) -> StepResult:
        return self._done.popleft()

    def forget(self, request_id: str) -> None:
        pass

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
