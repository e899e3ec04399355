"""What one engine step tells the attention kernels about its batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Layout of one flattened batch of new tokens.

    Tokens of decoding sequences (one each) come first, then the query tokens of
    prefilling sequences, sequence after sequence.  ``context_lens`` count every
    token of a sequence that is in the KV cache once this step's tokens are
    written, so a prefill chunk's queries sit at positions
    ``context_len - q_len .. context_len - 1``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) per new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int64
    prefill_context_lens: torch.Tensor  # [num_prefills] int64
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int64
    # Per-step precomputation a backend builds once and reuses in every layer.
    plan: dict[str, Any] = field(default_factory=dict)
    # KV groups 1.. of a model with sliding windows (their own slots and block tables, the same queries).
    groups: list[AttentionMetadata] = field(default_factory=list)

    def group(self, index: int) -> AttentionMetadata:
        return self.groups[index - 1] if index else self

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.numel()
