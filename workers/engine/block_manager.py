"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and who holds them.

Prefix caching: a full block is named by a hash chain over the tokens up to
its end (parent hash, its own token ids, the model's identity: ``block_hash``).  When a
sequence finishes, its full blocks stay in the pool with reference count 0,
still findable by hash, in LRU order; a new sequence whose prompt starts with
the same tokens takes them instead of recomputing.  Allocation reuses blocks
that hold nothing first, then evicts the least recently used cached block.

Sliding windows (``kv_layout.py``): with several KV groups a sequence holds one
table per group, all as long as its token count needs; a sliding group's
entries before its window are ``NULL_BLOCK`` once freed (``free_out_of_window``),
so its blocks stay bounded by the window however long the sequence grows.  A
prefix-cache hit needs every global group's blocks of the prefix, and of each
sliding group only the blocks its window still reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pagedq.workers.engine.block_hash import extend_hashes, salted
from pagedq.workers.engine.sequence import Sequence

NULL_BLOCK = -1  # a table entry whose block fell out of its group's window and was freed


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    group: int = 0  # the KV group whose table holds it (whose prefix cache names it)


@dataclass
class PrefixHit:
    """The cached prefix a waiting sequence adopts: per KV group, the blocks of its first ``len(hit)`` blocks
    (``NULL_BLOCK`` where a sliding group's window no longer reads one)."""

    tables: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tables[0]) if self.tables else 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_key: str = "", windows: Seq[int | None] = (None,)) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key  # the model's identity, so two models never share a block
        self.windows = tuple(windows)  # per KV group: its sliding window, or None (global)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0. Front = reused first: empty blocks, then cached ones from least recent.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Per group: block hash -> block id.  Group 0's is ``cached``, the set a worker reports for placement.
        self.group_cached: list[dict[bytes, int]] = [{} for _ in self.windows]
        self.cached = self.group_cached[0]
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

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def out_of_window(self, num_computed_tokens: int, window: int) -> int:
        """How many leading blocks a sliding group no longer reads once ``num_computed_tokens`` are computed
        (the next query sits at that position and reads keys after ``position - window``)."""
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def blocks_for(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` holds, prefilled ``chunk`` tokens a step."""
        whole = self.blocks_needed(num_tokens)
        return sum(whole if w is None else min(whole, self.blocks_needed(w - 1 + chunk) + 1) for w in self.windows)

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

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """Blocks holding the longest cached prefix of a sequence that has nothing computed yet.

        At least one token is always left to compute: the step must produce logits.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        self._update_hashes(seq, seq.num_tokens - 1)
        hashes = seq.block_hashes
        n = len(hashes)
        for cached, w in zip(self.group_cached, self.windows, strict=True):
            if w is None:  # a global group needs every block of the prefix
                n = next((i for i in range(n) if hashes[i] not in cached), n)
        # A sliding group needs only the blocks its window reads: shorten the prefix until each has them.
        last_missing = {}  # group -> [largest index < k whose block that group lacks, for each k]
        for g, (cached, w) in enumerate(zip(self.group_cached, self.windows, strict=True)):
            if w is not None:
                marks = [-1]
                for i in range(n):
                    marks.append(marks[-1] if hashes[i] in cached else i)
                last_missing[g] = marks
        while n and any(marks[n] >= self.out_of_window(n * self.block_size, self.windows[g])
                        for g, marks in last_missing.items()):
            n -= 1
        tables = []
        for cached, w in zip(self.group_cached, self.windows, strict=True):
            skip = 0 if w is None else min(n, self.out_of_window(n * self.block_size, w))
            tables.append([NULL_BLOCK] * skip + [cached[h] for h in hashes[skip:n]])
        return PrefixHit(tables)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        for g, table in enumerate(seq.block_tables):
            cached = self.group_cached[g]
            for block_id, block_hash in zip(table, seq.block_hashes, strict=False):
                if block_id == NULL_BLOCK:
                    continue
                block = self.blocks[block_id]
                if block.block_hash is None and block_hash not in cached:
                    block.block_hash = block_hash
                    cached[block_hash] = block_id
                    if g == 0 and self.changes is not None:
                        self.changes[block_hash] = True

    # --- allocation -------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: PrefixHit | None = None) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens (after any cached prefix it adopts).

        Returns False, changing nothing, when the pool is too small.
        """
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        hit = cached_blocks.tables if cached_blocks else None
        num_cached_tokens = len(hit[0]) * self.block_size if hit else 0
        total = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        per_group = max(self.blocks_needed(total) - len(seq.block_tables[0]) - num_cached_tokens // self.block_size, 0)
        if hit is None:
            if per_group * self.num_groups > self.num_free_blocks:
                return False
        else:
            revived = sum(1 for table in hit for b in table if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
            if per_group * self.num_groups > self.num_free_blocks - revived:
                return False
            for table, adopted in zip(seq.block_tables, hit, strict=True):
                for block_id in adopted:
                    if block_id != NULL_BLOCK:
                        block = self.blocks[block_id]
                        if block.ref_count == 0:
                            del self.free[block_id]
                        block.ref_count += 1
                    table.append(block_id)
            seq.num_computed_tokens += num_cached_tokens
        if per_group:
            for g, table in enumerate(seq.block_tables):
                for _ in range(per_group):
                    table.append(self._take_free_block(g))
        return True

    def _take_free_block(self, group: int = 0) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            del self.group_cached[block.group][block.block_hash]
            if block.group == 0 and self.changes is not None:
                self.changes[block.block_hash] = False
            block.block_hash = None
        block.ref_count, block.group = 1, group
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.block_hash is None:
                self.free.move_to_end(block_id, last=False)

    def free_out_of_window(self, seq: Sequence) -> None:
        """Free the blocks of ``seq``'s sliding groups that no query of it will read again."""
        for w, table in zip(self.windows, seq.block_tables, strict=True):
            if w is None:
                continue
            for b in range(min(self.out_of_window(seq.num_computed_tokens, w), len(table)) - 1, -1, -1):
                if table[b] == NULL_BLOCK:
                    break  # freed up to here already
                self._release(table[b])
                table[b] = NULL_BLOCK

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks first, so a prompt's later blocks are evicted before its (more shared) head.
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables = []
        seq.num_computed_tokens = 0
