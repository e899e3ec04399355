"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Every step first gives each running sequence its next tokens (one for a
decode, a chunk for an unfinished prefill), most urgent first, then admits
waiting sequences while the token budget and seat count allow; a prompt
longer than what is left of the budget is prefilled in chunks over several
steps.  When the KV pool runs dry the least urgent running sequence is
preempted: its blocks are freed and it waits to be recomputed.

Urgency is ``(priority desc, arrival asc)`` under the ``priority`` policy and
arrival order under ``fcfs``.

With pipeline stages several micro-batches are in flight at once.  A
sequence in one of them is *busy*: its next token is not known yet, so it is
neither scheduled nor preempted until its micro-batch comes back, and
``max_running`` caps how many running sequences one micro-batch takes, so the
running set splits evenly across the micro-batches (admissions stay bounded by
the token budget, so every micro-batch of a prefill-heavy phase fills it).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Set
from dataclasses import dataclass, field

from pagedq.workers.block_manager import BlockManager
from pagedq.workers.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "priority") -> None:
        if policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling policy must be 'priority' or 'fcfs', not {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[tuple[tuple, Sequence]] = []  # heap of (urgency key, seq)
        self.running: list[Sequence] = []  # most urgent first
        self.num_preemptions = 0

    def urgency(self, seq: Sequence) -> tuple:
        return (-seq.priority, seq.arrival) if self.policy == "priority" else (seq.arrival,)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (self.urgency(seq), seq))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is (abort or finish) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting = [item for item in self.waiting if item[1] is not seq]
            heapq.heapify(self.waiting)
        self.bm.free_sequence(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _least_urgent_idle(self, busy: Set[int]) -> Sequence | None:
        return next((s for s in reversed(self.running) if id(s) not in busy), None)

    def schedule(self, busy: Set[int] = frozenset(), max_running: int | None = None) -> SchedulerOutput:
        """Plan one step (one micro-batch); ``busy`` holds ``id()`` of sequences in flight."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        seats = max_running or len(self.running)  # no cap unless asked
        planned: dict[int, int] = {}  # id(seq) -> tokens this step

        # 1. Running sequences, most urgent first; preempt from the least urgent end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0 and len(planned) < seats:
            seq = self.running[i]
            if id(seq) in busy:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self._least_urgent_idle(busy)  # never None: seq itself is idle
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                planned[id(seq)] = n
                budget -= n
                i += 1
                continue
            break

        # 2. Waiting sequences, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0][1]
            if len(self.running) >= self.max_num_seqs and not self._make_room(seq, planned, out, busy):
                break
            cached = self.bm.find_cached_prefix(seq)
            n = min(seq.num_tokens - len(cached) * self.bm.block_size, budget)
            admitted = self.bm.allocate(seq, n, cached)
            while not admitted and self._make_room(seq, planned, out, busy):
                cached = self.bm.find_cached_prefix(seq)  # the victim's blocks may have been ours
                n = min(seq.num_tokens - len(cached) * self.bm.block_size, budget)
                admitted = self.bm.allocate(seq, n, cached)
            if not admitted:
                break
            budget = self.max_num_batched_tokens - sum(planned.values()) - n
            heapq.heappop(self.waiting)
            if seq.num_preemptions == 0:
                self.bm.stats.queries += seq.num_prompt_tokens
                self.bm.stats.hits += seq.num_computed_tokens
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.urgency)
            planned[id(seq)] = n

        out.scheduled = [(s, planned[id(s)]) for s in self.running if id(s) in planned]
        return out

    def _make_room(self, seq: Sequence, planned: dict[int, int], out: SchedulerOutput,
                   busy: Set[int] = frozenset()) -> bool:
        """Under the priority policy, preempt the least urgent idle running sequence if ``seq`` outranks it."""
        victim = self._least_urgent_idle(busy) if self.policy == "priority" else None
        if victim is None or victim.priority >= seq.priority:
            return False
        planned.pop(id(victim), None)
        self._preempt(victim, out)
        out.preempted.remove(victim)  # a priority swap, not a shortage: admission continues
        return True
