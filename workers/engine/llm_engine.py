"""LLMEngine: requests in, tokens out, one continuous batch.  No I/O, no tokenizer.

One step reads::

    sched = scheduler.schedule()            # which tokens of which sequences
    executor.submit(sched); executor.collect()   # run the model, sample
    scheduler.update_from_output(result)     # bookkeeping, stops by token id / length

``add_request``, ``abort_request`` and ``finish_request`` may be called from
any thread; they take effect at the start of the next step.  Stop strings are
not the core's business: whoever detokenizes the output calls
``finish_request(id, "stop")`` and the sequence ends at the next step.

A request with ``params.n`` > 1 is n sequences: the request's own (choice 0)
and choices ``choice_id(id, i)``, held back until choice 0 has computed the
prompt; seated then, they take its blocks from the prefix cache, so the prompt
is computed once (all but its last, partial block).  Each choice has its own
output (its own id); aborting the request aborts the choices still held back;
the others are aborted by id.

Building an engine (loading a model, choosing an executor) is ``pagedq.workers.llm``'s job.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pagedq.config.messages import RequestError, check_context, check_logit_bias
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta
from pagedq.workers.engine.block_hash import cache_key
from pagedq.workers.engine.block_manager import BlockManager
from pagedq.workers.engine.executor import Executor, ReplicaLostError
from pagedq.workers.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedq.workers.engine.sequence import Grammar, Sequence, SequenceStatus

log = logging.getLogger(__name__)


def choice_id(request_id: str, index: int) -> str:
    """The request id of choice ``index`` (>= 1) of a request with ``n`` > 1; choice 0 is the request's own."""
    return f"{request_id}#{index}"


def choice_ids(request_id: str, n: int) -> list[str]:
    return [choice_id(request_id, i) for i in range(1, n)]


@dataclass
class EngineConfig:
    """What the core needs to know about the model and the KV pool."""

    model_name: str
    fingerprint: str  # of the weights: the prefix cache's blocks are keyed by it
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    scheduling_policy: str = "priority"
    enable_prefix_caching: bool = True
    kv_windows: tuple[int | None, ...] = (None,)  # per KV group, its sliding window (``kv_layout.KVLayout``)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)  # every generated token's, when asked for
    num_preemptions: int = 0
    error: str | None = None  # with finish_reason "error": what the step raised
    prompt_logprobs: list[dict | None] | None = None  # once finished, when asked for (``Sequence.prompt_logprobs``)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.block_manager = BlockManager(executor.num_blocks, config.block_size, config.enable_prefix_caching,
                                          extra_key=cache_key(config.model_name, config.fingerprint),
                                          windows=config.kv_windows)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, config.eos_token_ids, config.max_model_len)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self.requests: dict[str, Sequence] = {}
        self._held: dict[str, list[Sequence]] = {}  # request id -> its other choices, until its prompt is computed
        self._spilled: list[RequestOutput] = []  # outputs of held choices ended with their request, for the next step
        # Builds a sequence's grammar state from ``params.constraint`` (``workers/grammar.py``); None: this
        # engine refuses constraints (its sampler runs in another process, see ``LLM``).
        self.new_grammar: Callable[[list[str]], Grammar] | None = None
        self.no_grammar_reason = "structured outputs are not available on this engine"
        self.lock = threading.Lock()  # held during a step

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def fingerprint(self) -> str:
        return self.config.fingerprint

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def reset_stats(self) -> SchedulerStats:
        return self.scheduler.reset_stats()

    # --- requests ---------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request this engine cannot run."""
        check_context(prompt_token_ids, params.max_tokens, self.config.max_model_len, self.config.vocab_size)
        check_logit_bias(params.logit_bias, self.config.vocab_size)
        need = len(prompt_token_ids) + params.max_tokens
        bm, chunk = self.block_manager, self.config.max_num_batched_tokens
        if bm.blocks_for(need, chunk) > bm.num_blocks:
            capacity = bisect.bisect(range(need), False, key=lambda n: bm.blocks_for(n, chunk) > bm.num_blocks) - 1
            raise RequestError(f"prompt + max_tokens = {need} tokens exceed the KV cache ({capacity} tokens); "
                               "raise kv_cache_memory", "max_tokens", code="context_length_exceeded")
        if params.constraint is not None:
            if params.ignore_eos:
                raise RequestError("ignore_eos: cannot be combined with a structured-output constraint",
                                   "ignore_eos")
            if self.new_grammar is None:
                raise RequestError(f"response_format: {self.no_grammar_reason}", "response_format")

    def grammar_for(self, params: SamplingParams) -> Grammar | None:
        """The grammar state a request needs (None without a constraint).  Compiles on the caller's thread:
        call it before ``add_request`` from a thread that is not stepping."""
        if params.constraint is None:
            return None
        if self.new_grammar is None:
            raise RequestError(f"response_format: {self.no_grammar_reason}", "response_format")
        try:
            return self.new_grammar(params.constraint)
        except Exception as e:  # noqa: BLE001 - the edge check should have caught it; still the request's fault
            raise RequestError(f"response_format: cannot compile the {params.constraint[0]}: {e}",
                               "response_format") from None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, meta: SchedulingMeta | None = None, grammar: Grammar | None = None,
                    choice_grammars: list[Grammar | None] | None = None) -> None:
        """``meta`` (tenant, deadline) places the request among the waiting ones (``Scheduler``); ``priority``
        is its band.  A constrained request takes ``grammar`` (``grammar_for``) and, with ``n`` > 1, one for
        each other choice (``choice_grammars``), or compiles them here."""
        self.validate(prompt_token_ids, params)
        if grammar is None:
            grammar = self.grammar_for(params)
        ids = choice_ids(request_id, params.n)
        if choice_grammars is None:
            choice_grammars = [self.grammar_for(params) for _ in ids]
        seq = Sequence(request_id, prompt_token_ids, params, priority, meta, grammar)
        others = [Sequence(cid, prompt_token_ids, _choice_params(params, i), priority, meta, g)
                  for i, (cid, g) in enumerate(zip(ids, choice_grammars, strict=True), start=1)]
        self._inbox.put(("add", (seq, others)))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def finish_request(self, request_id: str, reason: str = "stop", stop_reason: int | str | None = None) -> None:
        """End a request from outside the core (a stop string matched); its last output says ``reason``."""
        self._inbox.put(("finish", (request_id, reason, stop_reason)))

    def _drain_inbox(self) -> list[RequestOutput]:
        ended: list[RequestOutput] = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return ended
            if kind == "add":
                seq, others = item
                if seq.request_id in self.requests:
                    log.warning("request %s already in the engine; duplicate ignored", seq.request_id)
                    continue
                self._seat(seq)
                if others:
                    self._held[seq.request_id] = others
            elif kind == "abort":
                self._end(item, "abort", None, ended)
            else:
                self._end(*item, ended)

    def _end(self, request_id: str, reason: str, stop_reason, ended: list[RequestOutput]) -> None:
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        seq.stop_reason = stop_reason
        if self.scheduler.finish(seq, reason):
            self._retire(seq)
            ended.append(self._output(seq, 0))
        # else: in a micro-batch in flight; it ends when that comes back (update_from_output)

    def _seat(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def _release_choices(self, seq: Sequence) -> None:
        """Seat the held choices of a request whose prompt is computed; end them with it if it ended first."""
        others = self._held.pop(seq.request_id, None)
        for other in others or ():
            if seq.finish_reason in ("abort", "error"):
                other.status, other.finish_reason, other.error = SequenceStatus.FINISHED, seq.finish_reason, seq.error
                self._spilled.append(self._output(other, 0))
            else:
                self._seat(other)

    def _retire(self, seq: Sequence) -> None:
        del self.requests[seq.request_id]
        self.executor.forget(seq.request_id)
        self._release_choices(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._spilled) or not self._inbox.empty()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # --- the step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule micro-batches until the executor is full, then take the oldest one's tokens.

        In one process that is one batch, run at once.  With S pipeline stages
        up to S micro-batches are in flight, none sharing a sequence.
        """
        with self.lock:
            outputs = self._drain_inbox()
            outputs += self._spilled
            self._spilled = []
            ex = self.executor
            while ex.num_inflight < ex.max_inflight:
                sched = self.scheduler.schedule(self._micro_batch_seats())
                if sched.is_empty:
                    break
                try:
                    ex.submit(sched)
                except ReplicaLostError:
                    raise
                except Exception as e:  # noqa: BLE001 - contained to the request that caused it
                    outputs += self._step_failed(sched, e)
                    return outputs
            if not ex.num_inflight:
                ex.check()
                return outputs
            result = ex.collect()
            stepped, finished = self.scheduler.update_from_output(result)
            outputs.extend(self._output(seq, 1) for seq in stepped)
            for seq in stepped if self._held else ():  # requests with n > 1 waiting for their prompt
                if seq.request_id in self._held and seq.num_computed_tokens >= seq.num_prompt_tokens:
                    self._release_choices(seq)
            for seq in finished:
                if seq not in stepped:  # ended from outside while in flight
                    outputs.append(self._output(seq, 0))
                self._retire(seq)
            return outputs

    def _step_failed(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A micro-batch raised before any of its tokens came back.

        Its sequences are idle again (their tokens are recomputed).  Alone in the batch, a sequence is
        the culprit and ends with ``finish_reason="error"``; otherwise each is run alone next
        (``Scheduler.probe``), so only the one that raises again fails and its batch mates go on.
        """
        seqs = self.scheduler.abandon(sched)
        if len(seqs) > 1:
            log.warning("a step of %d requests raised %s: %s; running each alone to find the cause",
                        len(seqs), type(error).__name__, error)
            self.scheduler.probe.extend(seqs)
            return []
        seq = seqs[0]
        log.error("request %s raised %s: %s; it fails, the others go on", seq.request_id, type(error).__name__, error)
        seq.error = f"{type(error).__name__}: {error}"
        self.scheduler.finish(seq, "error")
        self._retire(seq)
        return [self._output(seq, 0)]

    def _micro_batch_seats(self) -> int | None:
        """Running sequences the next micro-batch may take: an even share of all of them.

        A share of *all* running sequences, not of those not in flight: otherwise the micro-batch
        that comes back first keeps every newcomer it admitted, its group grows, and the stages
        wait on the big micro-batch.
        """
        slots = self.executor.max_inflight
        if slots == 1:
            return None
        return max(1, -(-len(self.scheduler.running) // slots))

    def healthy(self) -> bool:
        """False once a process of this engine's replica has died (always True in one process)."""
        try:
            self.executor.check()
            return True
        except ReplicaLostError:
            return False

    def shutdown(self) -> None:
        """Stop the replica's other processes (nothing to do in one process)."""
        self.executor.shutdown()

    def _output(self, seq: Sequence, num_new: int) -> RequestOutput:
        new = seq.token_ids[-num_new:] if num_new else []
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new, output_token_ids=seq.output_token_ids,
            num_prompt_tokens=seq.num_prompt_tokens, finished=seq.is_finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, num_cached_tokens=seq.num_cached_prompt_tokens,
            logprobs=list(seq.logprobs), num_preemptions=seq.num_preemptions, error=seq.error,
            prompt_logprobs=seq.prompt_logprobs if seq.is_finished else None)

    # --- conveniences -----------------------------------------------------
    def run(self, requests: list[tuple[str, list[int], SamplingParams, int]],
            on_output: Callable[[RequestOutput], None] | None = None) -> dict[str, RequestOutput]:
        """Step until every request ``(id, prompt ids, params, priority)`` has finished; final outputs by id
        (a request's other choices under their own ids, ``choice_id``)."""
        wanted = set()
        for request_id, prompt, params, priority in requests:
            self.add_request(request_id, prompt, params, priority)
            wanted.update([request_id, *choice_ids(request_id, params.n)])
        finished: dict[str, RequestOutput] = {}
        while not wanted <= finished.keys():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    finished[out.request_id] = out
        return finished

    def replace_executor(self, executor: Executor, fingerprint: str) -> None:
        """New weights: a new executor and KV pool; requests in flight are recomputed from their tokens."""
        with self.lock:
            self.executor.shutdown()
            self.executor = executor
            self.config.fingerprint = fingerprint
            running = list(self.requests.values())
            old = self.scheduler
            self.block_manager = BlockManager(executor.num_blocks, self.config.block_size,
                                              self.config.enable_prefix_caching,
                                              extra_key=cache_key(self.config.model_name, fingerprint),
                                              windows=self.config.kv_windows)
            self.scheduler = Scheduler(self.block_manager, old.max_num_seqs, old.max_num_batched_tokens,
                                       old.policy, old.eos_token_ids, old.max_model_len, old.counters)
            self.scheduler.stats = old.stats
            for seq in running:  # their blocks belonged to the old pool
                seq.block_tables, seq.block_hashes, seq.num_computed_tokens = [], [], 0
                self.scheduler.add(seq)


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: a seeded request's choices draw from seeds ``seed + index``.  Choice 0
    scores the prompt for them all."""
    if params.num_prompt_logprobs is not None:
        params = replace(params, prompt_logprobs=None, echo=False)
    if params.seed is None:
        return params
    return replace(params, seed=(params.seed + index) % (1 << 63))


def new_request_id(prefix: str = "gen") -> str:
    return f"{prefix}-{time.monotonic_ns()}"
