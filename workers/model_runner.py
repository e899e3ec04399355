"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

import torch

from pagedq.kernels import AttentionMetadata
from pagedq.workers.model import CausalLM, ModelConfig
from pagedq.workers.sampler import SamplerOutput, sample
from pagedq.workers.scheduler import SchedulerOutput
from pagedq.workers.sequence import Sequence

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


def kv_cache_block_bytes(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        keep_freed_memory()
        self.model = model
        self.block_size = block_size
        self.device = device
        cfg = model.cfg
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                          for _ in model.layers]

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        decodes = sorted(((s, n) for s, n in sched.scheduled if n == 1), key=lambda x: x[0].num_computed_tokens)
        prefills = [(s, n) for s, n in sched.scheduled if n > 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:  # every known token computed: next token is due
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)

        def tables(group: list[tuple[Sequence, int]]) -> torch.Tensor:
            width = max((len(s.block_table) for s, _ in group), default=0)
            return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _ in group],
                                dtype=torch.long).view(len(group), width)

        def lens(group: list[tuple[Sequence, int]]) -> torch.Tensor:
            return torch.tensor([s.num_computed_tokens + n for s, n in group], dtype=torch.long)

        q_lens = torch.tensor([0] + [n for _, n in prefills], dtype=torch.long)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=tables(decodes).to(dev),
            decode_context_lens=lens(decodes).to(dev),
            prefill_cu_seqlens_q=q_lens.cumsum(0).to(dev),
            prefill_context_lens=lens(prefills).to(dev),
            prefill_block_tables=tables(prefills).to(dev),
        )
        return StepInputs(torch.tensor(input_ids, dtype=torch.long).to(dev), torch.tensor(positions).to(dev),
                          meta, torch.tensor(sample_rows, dtype=torch.long).to(dev), sample_seqs)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Sequence], SamplerOutput]:
        """One forward pass over the scheduled tokens; samples for sequences whose prompt is done."""
        inputs = self.prepare(sched)
        hidden = self.model.embed_tokens(inputs.input_ids)
        hidden = self.model.forward(hidden, inputs.positions, inputs.meta, self.kv_caches)
        if not inputs.sample_seqs:
            return [], SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return inputs.sample_seqs, sample(logits, inputs.sample_seqs)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
