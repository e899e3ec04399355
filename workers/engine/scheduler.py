"""Iteration-level scheduling: which tokens of which sequences run in the next step.

``schedule()`` plans one step (one micro-batch): it first gives each running
sequence that decodes its next token, most urgent first, then admits waiting
sequences of tenants with no prefill under way while the token budget and
seat count allow, then gives the running sequences still prefilling a chunk
each, the tenants holding the fewest seats first (so a chat prompt just
seated is not stuck behind another tenant's long ones), then admits waiting
sequences of any tenant with what is left.  A prompt longer than what is left
of the budget is prefilled in chunks over several steps, and its tenant seats
no other prompt before it is done (else a backlog starves it).  When the KV pool
runs dry the least urgent running sequence is preempted: its blocks are freed
and it waits to be recomputed.

``update_from_output()`` takes the step's sampled tokens back and does all of
the step's bookkeeping: computed tokens, full blocks into the prefix cache,
new tokens appended, stops by token id or length, finished sequences out of
the running set with their blocks freed.

Which waiting sequence is admitted next, under the ``priority`` policy, is the
fleet order (``pagedq.fleet.policy.FairQueue``, docs/queue.md "Which job
next"): strict priority; within a priority, the tenant with the least weighted
service (virtual token counters charged here with the prompt tokens of each
planned step, so one step's admissions already see each other, and the output
tokens generated); within a tenant, earliest start deadline, then arrival.
When every seat is taken, a waiting sequence of a tenant holding fewer seats
than its share takes the seat of a sequence of the most-seated tenant
(``fleet.policy.seat_share``; the fair dispatcher claims such a job beyond the
worker's seats).  Under ``fcfs`` it is arrival order.  Among running sequences
(who is preempted first) urgency is ``(priority desc, arrival asc)``, or
arrival under ``fcfs``.

With pipeline stages several micro-batches are in flight at once.  A
sequence in one of them is *busy*: its next token is not known yet, so it is
neither scheduled, preempted nor freed until its micro-batch comes back (an
abort of a busy sequence waits for that), and ``max_running`` caps how many
running sequences one micro-batch takes, so the running set splits evenly
across the micro-batches.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedq.config.scheduling import SchedulingMeta
from pagedq.fleet.policy import FairQueue, VirtualTokenCounters, below_share, seat_share
from pagedq.workers.engine.block_manager import BlockManager, PrefixHit
from pagedq.workers.engine.executor import StepResult
from pagedq.workers.engine.sequence import Sequence, SequenceStatus


def _prompt_part(seq: Sequence, n: int) -> int:
    """How many of the next ``n`` tokens of ``seq`` to compute are prompt tokens."""
    return max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters since the scheduler started, or since the last ``reset_stats()``."""

    steps: int = 0  # micro-batches whose tokens came back
    prompt_tokens_computed: int = 0  # includes recomputation after preemption
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, served from it
    kv_slots_allocated: int = 0  # summed over steps: blocks held by running sequences x block size
    kv_tokens_stored: int = 0  # summed over steps: tokens those blocks hold
    kv_peak_slots: int = 0  # the most slots running sequences held at once
    kv_peak_waste_fraction: float = 0.0  # share of those holding no token, at that step

    @property
    def kv_waste_fraction(self) -> float:
        """Share of allocated KV slots holding no token, averaged over steps."""
        return 1 - self.kv_tokens_stored / self.kv_slots_allocated if self.kv_slots_allocated else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(kv_waste_fraction=self.kv_waste_fraction, prefix_hit_rate=self.prefix_hit_rate)
        return d


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "priority", eos_token_ids: frozenset[int] = frozenset(),
                 max_model_len: int = 1 << 30, counters: VirtualTokenCounters | None = None) -> None:
        if policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling policy must be 'priority' or 'fcfs', not {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.counters = counters or VirtualTokenCounters()  # per tenant: weighted tokens served here
        self.waiting: FairQueue[Sequence] = FairQueue(self.counters)
        self.running: list[Sequence] = []  # most urgent first
        self.busy: set[int] = set()  # id() of sequences in micro-batches in flight
        self._deferred: dict[int, tuple[Sequence, str]] = {}  # busy sequences to finish when they come back
        self.probe: deque[Sequence] = deque()  # after a failed step: each runs alone, in turn
        self.stats = SchedulerStats()

    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens the waiting sequences still have to compute (a prefix cache hit may lower it)."""
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    def reset_stats(self) -> SchedulerStats:
        """Start a fresh measurement; returns the counters of the one that ends."""
        ended, self.stats = self.stats, SchedulerStats()
        return ended

    def urgency(self, seq: Sequence) -> tuple:
        return (-seq.priority, seq.arrival) if self.policy == "priority" else (seq.arrival,)

    def place(self, seq: Sequence) -> SchedulingMeta:
        """Where a sequence waits: its band, tenant, deadline and arrival; one band and tenant under ``fcfs``."""
        if self.policy == "priority":
            return SchedulingMeta(seq.tenant, seq.priority, seq.deadline, seq.arrival)
        return SchedulingMeta("", 0, None, seq.arrival)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq, self.place(seq))

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End a sequence from outside (abort, stop string): out of the queues, blocks freed.

        Returns False when the sequence is in a micro-batch in flight: it ends when that comes back.
        """
        if id(seq) in self.busy:
            self._deferred[id(seq)] = (seq, reason)
            return False
        self._remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return True

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free_sequence(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _least_urgent_idle(self, exclude: dict[int, int] | None = None) -> Sequence | None:
        return next((s for s in reversed(self.running) if id(s) not in self.busy and id(s) not in (exclude or {})),
                    None)

    def abandon(self, sched: SchedulerOutput) -> list[Sequence]:
        """A planned micro-batch that never ran: its sequences are idle again, their tokens still to compute."""
        for seq, _ in sched.scheduled:
            self.busy.discard(id(seq))
        return [seq for seq, _ in sched.scheduled]

    # --- planning a step ------------------------------------------------------
    def schedule(self, max_running: int | None = None) -> SchedulerOutput:
        """Plan one micro-batch of sequences not already in flight; they are busy until it comes back."""
        while self.probe and self.probe[0].status != SequenceStatus.RUNNING:
            self.probe.popleft()  # finished or preempted meanwhile: nothing to single out
        if self.probe:
            return self._schedule_alone(self.probe[0])
        out = SchedulerOutput()
        # No cap unless asked.  (It was the running count before admissions: a step that seated as many as were
        # running left no seat for the running prefills.)
        seats = max_running or self.max_num_seqs
        planned: dict[int, int] = {}  # id(seq) -> tokens this step

        # 1. Running sequences' decodes (a token each), most urgent first.
        self._schedule_running(planned, out, seats, decodes=True)

        # 2. Waiting sequences of tenants with no prefill under way, unless this step already had to preempt.
        self._admit_waiting(planned, out, only=self._not_prefilling())

        # 3. Running sequences' unfinished prefills with what is left, the tenants holding the fewest seats first
        #    (``_prefill_order``): a chat prompt seated this step does not wait behind a flood's long ones.
        self._schedule_running(planned, out, seats, decodes=False)

        # 4. Waiting sequences of any tenant with what is left.  A tenant's prompt seated with part of its prefill
        #    gets the rest (3) before that tenant's next prompt is seated: seated first, it starved while its own
        #    tenant had a backlog (a step's last prompt waited until the backlog ended).
        self._admit_waiting(planned, out)

        out.scheduled = [(s, planned[id(s)]) for s in self.running if id(s) in planned]
        self.busy.update(planned)
        self._record_kv_usage(planned)
        return out

    def _admit_waiting(self, planned: dict[int, int], out: SchedulerOutput,
                       only: Callable[[str], bool] | None = None) -> None:
        """Seat waiting sequences in the fleet order while the step has budget (``only``: of those tenants, in
        the highest band), unless this step already had to preempt for want of blocks."""
        budget = self.max_num_batched_tokens - sum(planned.values())
        while len(self.waiting) and budget > 0 and not out.preempted:
            seq = self.waiting.peek(only)
            if seq is None:
                break
            if len(self.running) >= self.max_num_seqs and not self._make_room(seq, planned, out):
                seq = self._seat_below_share(planned, out, only)
                if seq is None:
                    break
            n = self._admit(seq, budget)
            while n is None and self._make_room(seq, planned, out):
                n = self._admit(seq, budget)  # the victim's blocks may have been our prefix
            if n is None:
                break
            budget = self.max_num_batched_tokens - sum(planned.values()) - n
            if self.waiting.peek() is seq:  # it is: a victim re-queued above waits in a lower band
                self.waiting.pop()
            else:
                self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                self.stats.prefix_queries += seq.num_prompt_tokens
                self.stats.prefix_hits += seq.num_computed_tokens
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self.urgency)
            self._plan(seq, n, planned)

    def _not_prefilling(self) -> Callable[[str], bool]:
        """Whether a tenant (as ``place`` names it) has no idle running sequence still prefilling."""
        prefilling = {self.place(s).tenant for s in self.running
                      if s.num_tokens - s.num_computed_tokens > 1 and id(s) not in self.busy}
        return lambda tenant: tenant not in prefilling

    def _schedule_running(self, planned: dict[int, int], out: SchedulerOutput, seats: int, decodes: bool) -> None:
        """Plan the idle running sequences' next tokens: those decoding, or those still prefilling (a chunk each).
        When blocks run out, preempt from the least urgent end (never a sequence already planned this step)."""
        budget = self.max_num_batched_tokens - sum(planned.values())
        todo = [s for s in self.running if id(s) not in self.busy and id(s) not in planned
                and (s.num_tokens - s.num_computed_tokens == 1) == decodes]
        if not decodes and self.policy == "priority":
            todo.sort(key=self._prefill_order())
        for seq in todo:
            if budget <= 0 or len(planned) >= seats:
                return
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an earlier one
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self._least_urgent_idle(exclude=planned) or seq
                self._preempt(victim, out)
                if victim is seq:
                    return
            self._plan(seq, n, planned)
            budget -= n

    def _prefill_order(self):
        """The order in which running sequences still prefilling get their next chunk: by band, then the tenant
        holding the fewest seats for its weight, then arrival.  A tenant below its seat share (one chat prompt of
        470 tokens beside another tenant's twenty long prompts) finishes its prefill first, not after all of
        theirs; tenants at their shares keep arrival order."""
        held = Counter(s.tenant for s in self.running)
        weight = self.counters.weight
        return lambda s: (-s.priority, held[s.tenant] / weight(s.tenant), s.arrival)

    def _plan(self, seq: Sequence, n: int, planned: dict[int, int]) -> None:
        """``n`` tokens of ``seq`` run this step."""
        planned[id(seq)] = n
        self._charge_prompt(seq, n)

    def _charge_prompt(self, seq: Sequence, n: int) -> None:
        """Charge the prompt tokens among the next ``n`` of ``seq`` to its tenant as the step is planned, not when
        they come back: the next admission of this same step already sees them (charged later, a tenant that
        wins one admission would win every admission of the step)."""
        if prompt := _prompt_part(seq, n):
            self.counters.charge(seq.tenant, prompt_tokens=prompt)

    def _schedule_alone(self, seq: Sequence) -> SchedulerOutput:
        """One suspect of a failed step, alone (nothing else runs until it is cleared or has failed)."""
        out = SchedulerOutput()
        if id(seq) in self.busy:
            return out
        n = min(seq.num_tokens - seq.num_computed_tokens, self.max_num_batched_tokens)
        while not self.bm.allocate(seq, n):
            victim = self._least_urgent_idle()
            self._preempt(victim, out)
            if victim is seq:
                return out
        self._charge_prompt(seq, n)
        out.scheduled = [(seq, n)]
        self.busy.add(id(seq))
        return out

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence its cached prefix and room for its next chunk: the chunk's size, or None."""
        # A prompt to score is computed whole: a cached block holds K/V, not the logits of its positions.
        cached = PrefixHit() if seq.scores_prompt else self.bm.find_cached_prefix(seq)
        n = min(seq.num_tokens - len(cached) * self.bm.block_size, budget)
        return n if self.bm.allocate(seq, n, cached) else None

    def _make_room(self, seq: Sequence, planned: dict[int, int], out: SchedulerOutput) -> bool:
        """Under the priority policy, preempt the least urgent idle running sequence if ``seq`` outranks it."""
        victim = self._least_urgent_idle() if self.policy == "priority" else None
        if victim is None or victim.priority >= seq.priority:
            return False
        self._swap_out(victim, planned, out)
        return True

    def _seat_below_share(self, planned: dict[int, int], out: SchedulerOutput,
                          only: Callable[[str], bool] | None = None) -> Sequence | None:
        """Every seat is taken: the next waiting sequence (highest band) of a tenant holding fewer seats than its
        share (``fleet.policy.seat_share``), for which an idle sequence of the most-seated tenant above its share
        in that band or below is preempted; None if there is no such pair (or under ``fcfs``)."""
        if self.policy != "priority":
            return None
        held = Counter(s.tenant for s in self.running)
        weight = self.counters.weight
        below = below_share(held, self.max_num_seqs, weight)
        seq = self.waiting.peek(below if only is None else lambda t: below(t) and only(t))
        if seq is None:
            return None
        over = {t for t, n in held.items()  # once per tenant, not per running sequence
                if n > seat_share(held, t, self.max_num_seqs, weight, joining=seq.tenant)}
        idle = [s for s in reversed(self.running)  # least urgent first
                if s.tenant in over and id(s) not in self.busy and s.priority <= seq.priority]
        if not idle:
            return None
        most = max(held[s.tenant] for s in idle)
        self._swap_out(next(s for s in idle if held[s.tenant] == most), planned, out)
        return seq

    def _swap_out(self, victim: Sequence, planned: dict[int, int], out: SchedulerOutput) -> None:
        planned.pop(id(victim), None)
        self._preempt(victim, out)
        out.preempted.remove(victim)  # a swap, not a shortage: admission continues

    def _record_kv_usage(self, planned: dict[int, int]) -> None:
        """Slots held by running sequences' blocks vs the tokens in them once this batch is written."""
        allocated = sum(len(seq.block_table) for seq in self.running) * self.bm.block_size
        stored = sum(seq.num_computed_tokens + planned.get(id(seq), 0) for seq in self.running)
        st = self.stats
        st.kv_slots_allocated += allocated
        st.kv_tokens_stored += stored
        if allocated > st.kv_peak_slots:
            st.kv_peak_slots, st.kv_peak_waste_fraction = allocated, 1 - stored / allocated

    # --- taking a step's results back ---------------------------------------------
    def update_from_output(self, result: StepResult) -> tuple[list[Sequence], list[Sequence]]:
        """Apply a micro-batch's sampled tokens.

        Returns (sequences that got a token, sequences that finished); the finished ones have
        left the scheduler and their blocks are free (full blocks stay in the prefix cache).
        """
        st = self.stats
        for seq, n in result.sched.scheduled:
            self.busy.discard(id(seq))
            st.prompt_tokens_computed += _prompt_part(seq, n)  # its tenant was charged when it was planned
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            self.bm.free_out_of_window(seq)
        if result.sampled.prompt_logprobs:
            by_id = {seq.request_id: seq for seq, _ in result.sched.scheduled}
            for request_id, position, entries in result.sampled.prompt_logprobs:
                by_id[request_id].prompt_logprobs[position:] = entries
        finished: list[Sequence] = []
        stepped: list[Sequence] = []
        served: dict[str, int] = {}  # tenant -> tokens generated this step, charged once per tenant below
        for seq, token, logprob in zip(result.seqs, result.sampled.token_ids, result.sampled.logprobs,
                                       strict=True):
            if seq.params.max_tokens == 0:  # its prompt is scored; it generates nothing
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                self._remove(seq)
                finished.append(seq)
                continue
            stepped.append(seq)
            served[seq.tenant] = served.get(seq.tenant, 0) + 1
            seq.token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            self._check_stop(seq, token)
            if seq.is_finished:
                self._remove(seq)
                finished.append(seq)
        for tenant, n in served.items():
            self.counters.charge(tenant, output_tokens=n)
        for seq, _ in result.sched.scheduled:
            if (deferred := self._deferred.pop(id(seq), None)) and not seq.is_finished:
                self.finish(seq, deferred[1])
                finished.append(seq)
        if self.probe and any(seq is self.probe[0] for seq, _ in result.sched.scheduled):
            self.probe.popleft()  # it ran alone without raising: not the cause
        st.steps += 1
        st.generated_tokens += len(stepped)
        return stepped, finished

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reason, stop = None, None
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_set:
            reason, stop = "stop", token
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop
