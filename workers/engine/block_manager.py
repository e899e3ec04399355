"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and who holds them.

Prefix caching: a full block is named by a hash chain over the tokens up to
its end (parent hash, its own token ids, the model's identity: ``block_hash``).  When a
sequence finishes, its full blocks stay in the pool with reference count 0,
still findable by hash, in LRU order; a new sequence whose prompt starts with
the same tokens takes them instead of recomputing.  Allocation reuses blocks
that hold nothing first, then evicts the least recently used cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedq.workers.engine.block_hash import extend_hashes, salted
from pagedq.workers.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_key: str = "") -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key  # the model's identity, so two models never share a block
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0. Front = reused first: empty blocks, then cached ones from least recent.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # With track_changes(): block hash -> True (cached) / False (evicted) since the last take_changes().
        self.changes: dict[bytes, bool] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # --- prefix cache -----------------------------------------------------
    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_hashes`` over its full blocks among the first ``num_tokens`` tokens."""
        key = salted(self.extra_key, seq.params.cache_salt)  # a tenant's blocks are its own (issue 48)
        extend_hashes(seq.block_hashes, seq.token_ids, num_tokens, self.block_size, key)

    def track_changes(self) -> None:
        """From now on, record which blocks enter and leave the prefix cache (for ``take_changes``)."""
        self.changes = {}

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(cached, evicted): the block hashes whose presence in the prefix cache changed since the last call,
        each in its latest state (a block cached then evicted in between is only evicted)."""
        if not self.changes:
            return [], []
        changes, self.changes = self.changes, {}
        return [h for h, c in changes.items() if c], [h for h, c in changes.items() if not c]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence that has nothing computed yet.

        At least one token is always left to compute: the step must produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(seq, seq.num_tokens - 1)
        hit: list[int] = []
        for block_hash in seq.block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        for block_id, block_hash in zip(seq.block_table, seq.block_hashes, strict=False):
            block = self.blocks[block_id]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block_id
                if self.changes is not None:
                    self.changes[block_hash] = True

    # --- allocation -------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens (after any ``cached_blocks`` it adopts).

        Returns False, changing nothing, when the pool is too small.
        """
        cached_blocks = cached_blocks or []
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        new_needed = self.blocks_needed(total) - len(seq.block_table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)  # leave the free list
        if new_needed > self.num_free_blocks - revived:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens += num_cached_tokens
        for _ in range(max(new_needed, 0)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            del self.cached[block.block_hash]
            if self.changes is not None:
                self.changes[block.block_hash] = False
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks first, so a prompt's later blocks are evicted before its (more shared) head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
