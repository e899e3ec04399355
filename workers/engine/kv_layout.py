"""Which KV-cache group each layer's keys and values live in, when some layers slide and others do not.

A sliding-window layer needs only the last ``window`` positions; a global layer
needs them all.  So the layers are split into *groups* of one kind each, and a
sequence holds one block table per group (``Sequence.block_tables``): a sliding
group's table frees the blocks that fall out of its window, a global group's
keeps them all (vLLM's hybrid allocator has the same shape).

Every group has the same number of layers (the gcd of the kinds' layer counts),
so a block of the one shared pool is the same size in every group: block ``b``
of group ``g`` is row ``b`` of the cache tensors of group ``g``'s layers, and
layer ``j`` of every group shares cache tensor ``j`` (its *slot*).  A model
whose layers are all alike has one group holding every layer, which is the
layout of a model without windows: one table, one tensor per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per group: its sliding window, or None for global attention
    layer_group: tuple[int, ...]  # per layer of the model: its group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def stage_slots(self, first: int, last: int) -> tuple[list[int], int]:
        """For layers ``first .. last - 1`` (one pipeline stage): each layer's cache tensor, and how many tensors.

        A layer shares its tensor with the layers of other groups at the same place in their group.
        """
        seen = [0] * self.num_groups
        slots = []
        for g in self.layer_group[first:last]:
            slots.append(seen[g])
            seen[g] += 1
        return slots, max(seen, default=0)


def kv_layout(layer_windows: list[int | None]) -> KVLayout:
    """Groups for layers with these windows: global layers' groups first, then each window's."""
    kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    counts = [layer_windows.count(k) for k in kinds]
    per_group = math.gcd(*counts)
    windows: list[int | None] = []
    first_group = {}
    for kind, count in zip(kinds, counts, strict=True):
        first_group[kind] = len(windows)
        windows += [kind] * (count // per_group)
    seen = dict.fromkeys(kinds, 0)
    layer_group = []
    for w in layer_windows:
        layer_group.append(first_group[w] + seen[w] // per_group)
        seen[w] += 1
    return KVLayout(tuple(windows), tuple(layer_group))

