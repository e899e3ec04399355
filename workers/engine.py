"""LLMEngine: requests in, tokens out, one continuous batch.

``step()`` schedules, runs the model once, samples, and reports what each
running request gained.  ``add_request`` and ``abort_request`` may be called
from any thread; they take effect at the start of the next step.

The model runs in this process, or in a replica of processes (pipeline
stages x tensor-parallel shards, ``settings.pipeline_stages`` /
``tensor_parallel``) that this engine drives as their rank 0; see
``executor.py``.  A replica that loses a process raises ReplicaLostError from
``step()``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedq.config import Settings, get_settings
from pagedq.kernels import get_attention_backend
from pagedq.workers.block_manager import BlockManager
from pagedq.workers.detokenizer import decode_output
from pagedq.workers.distributed import ParallelConfig, ReplicaLostError
from pagedq.workers.executor import LocalExecutor, PipelineExecutor
from pagedq.workers.model import CausalLM, ModelConfig, load_weights
from pagedq.workers.model_loader import resolve_model
from pagedq.workers.model_runner import ModelRunner, kv_cache_block_bytes, pick_device
from pagedq.workers.sampling_params import InvalidRequestError, SamplingParams
from pagedq.workers.scheduler import Scheduler
from pagedq.workers.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)  # every generated token's, when asked for
    num_preemptions: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # includes recomputation after preemption
    generated_tokens: int = 0
    preemptions: int = 0
    kv_slots_allocated: int = 0  # summed over steps: blocks held by running sequences x block size
    kv_tokens_stored: int = 0  # summed over steps: tokens those blocks hold
    kv_peak_slots: int = 0  # the most slots running sequences held at once
    kv_peak_waste_fraction: float = 0.0  # share of those holding no token, at that step
    prefix_queries: int = 0
    prefix_hits: int = 0

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


def fingerprint_weights(weights: dict[str, torch.Tensor]) -> str:
    """Hash of every weight's name, shape, dtype and bytes: different weights, different fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()


class LLMEngine:
    def __init__(self, settings: Settings | None = None, model: str | None = None) -> None:
        s = self.settings = settings or get_settings()
        if s.num_threads:
            torch.set_num_threads(s.num_threads)
        source = resolve_model(model or s.model, s.state_dir)
        self.model_name = source.name
        self.model_path = source.path
        self.cfg = ModelConfig.from_folder(source.path)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(source.path)
        self.device = pick_device(s.device)
        self.dtype = getattr(torch, s.dtype)
        self.max_model_len = min(s.max_model_len or self.cfg.max_position_embeddings,
                                 self.cfg.max_position_embeddings, self.cfg.sliding_window or 1 << 30)
        self.eos_token_ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._load(load_weights(source.path))
        self._inbox: queue.Queue = queue.Queue()
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.lock = threading.Lock()  # held during a step; reload_weights takes it too

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        s = self.settings
        self.fingerprint = fingerprint_weights(weights)
        if ParallelConfig(s.pipeline_stages, s.tensor_parallel).is_distributed:
            self.executor = PipelineExecutor.start(self.cfg, weights, self.model_name, s, self.device, self.dtype)
            num_blocks, backend = self.executor.num_blocks, self.executor.runner.model.attention.name
        else:
            attention = get_attention_backend(s.attention_backend, self.device)
            self.model = CausalLM(self.cfg, weights, device=self.device, dtype=self.dtype, attention=attention)
            num_blocks = s.num_kv_blocks or s.kv_cache_memory // kv_cache_block_bytes(
                self.cfg, len(self.model.layers), s.block_size, self.dtype)
            if num_blocks < 2:
                raise ValueError(f"kv_cache_memory={s.kv_cache_memory} holds fewer than 2 blocks")
            self.runner = ModelRunner(self.model, num_blocks, s.block_size, self.device, self.dtype)
            self.executor = LocalExecutor(self.runner)
            backend = attention.name
        self.block_manager = BlockManager(num_blocks, s.block_size, s.enable_prefix_caching,
                                          extra_key=f"{self.model_name}:{self.fingerprint}")
        self.scheduler = Scheduler(self.block_manager, s.max_num_seqs, s.max_num_batched_tokens,
                                   s.scheduling_policy)
        self._busy: set[int] = set()  # id() of sequences in micro-batches in flight
        self._pending_aborts: list[str] = []  # aborts of busy sequences, applied when they come back
        log.info("engine ready: %s (%s), %d KV blocks x %d tokens, attention=%s, %d stage(s) x %d shard(s)",
                 self.model_name, self.fingerprint[:12], num_blocks, s.block_size, backend, s.pipeline_stages,
                 s.tensor_parallel)

    # --- requests ---------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this engine cannot run."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the request needs "
                f"{n + params.max_tokens} ({n} in the prompt, {params.max_tokens} in max_tokens)")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if n + params.max_tokens > capacity:
            raise InvalidRequestError(f"prompt + max_tokens = {n + params.max_tokens} tokens exceed the KV "
                                      f"cache ({capacity} tokens); raise kv_cache_memory")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        self.validate(prompt_token_ids, params)
        self._inbox.put(("add", Sequence(request_id, prompt_token_ids, params, priority)))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _drain_inbox(self) -> list[RequestOutput]:
        aborted = []
        pending, self._pending_aborts = self._pending_aborts, []
        for request_id in pending:
            self._abort(request_id, aborted)
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return aborted
            if kind == "add":
                if item.request_id in self.requests:
                    log.warning("request %s already in the engine; duplicate ignored", item.request_id)
                    continue
                self.requests[item.request_id] = item
                self.scheduler.add(item)
            elif kind == "abort":
                self._abort(item, aborted)

    def _abort(self, request_id: str, aborted: list[RequestOutput]) -> None:
        seq = self.requests.get(request_id)
        if seq is None:
            return
        if id(seq) in self._busy:  # its micro-batch is still writing its KV blocks: free them after
            self._pending_aborts.append(request_id)
            return
        self._retire(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        aborted.append(self._output(seq, 0))

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        del self.requests[seq.request_id]
        self.executor.forget(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or not self._inbox.empty()

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
            ex = self.executor
            while ex.num_inflight < ex.max_inflight:
                sched = self.scheduler.schedule(self._busy, self._micro_batch_seats())
                if sched.is_empty:
                    break
                self._record_kv_usage(sched)
                ex.submit(sched)
                self._busy.update(id(seq) for seq, _ in sched.scheduled)
            if not ex.num_inflight:
                ex.check()
                return outputs
            done = ex.collect()
            for seq, n in done.sched.scheduled:
                self._busy.discard(id(seq))
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.stats.prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
            for seq, token, logprob in zip(done.seqs, done.sampled.token_ids, done.sampled.logprobs, strict=True):
                seq.token_ids.append(token)
                if logprob is not None:
                    seq.logprobs.append(logprob)
                self._check_stop(seq, token)
                outputs.append(self._output(seq, 1))
                if seq.is_finished:
                    self._retire(seq)
            self.stats.steps += 1
            self.stats.generated_tokens += len(done.seqs)
            self.stats.preemptions = self.scheduler.num_preemptions
            self.stats.prefix_queries = self.block_manager.stats.queries
            self.stats.prefix_hits = self.block_manager.stats.hits
            return outputs

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

    def _record_kv_usage(self, sched) -> None:
        """Slots held by running sequences' blocks vs the tokens in them once this batch is written."""
        new = {id(seq): n for seq, n in sched.scheduled}
        running = self.scheduler.running
        allocated = sum(len(seq.block_table) for seq in running) * self.block_manager.block_size
        stored = sum(seq.num_computed_tokens + new.get(id(seq), 0) for seq in running)
        st = self.stats
        st.kv_slots_allocated += allocated
        st.kv_tokens_stored += stored
        if allocated > st.kv_peak_slots:
            st.kv_peak_slots, st.kv_peak_waste_fraction = allocated, 1 - stored / allocated

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reason, stop = None, None
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop = "stop", token
        elif p.stop and (matched := decode_output(self.tokenizer, seq.output_token_ids, p.stop)[1]):
            reason, stop = "stop", matched
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop

    def _output(self, seq: Sequence, num_new: int) -> RequestOutput:
        new = seq.token_ids[-num_new:] if num_new else []
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new, output_token_ids=seq.output_token_ids,
            num_prompt_tokens=seq.num_prompt_tokens, finished=seq.is_finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, num_cached_tokens=seq.num_cached_prompt_tokens,
            logprobs=list(seq.logprobs),
            num_preemptions=seq.num_preemptions)

    # --- conveniences -----------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 priorities: list[int] | None = None, on_step=None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            self.add_request(rid, prompt, params_list[i], priorities[i] if priorities else 0)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
            if on_step:
                on_step(finished)
        return [finished[rid] for rid in ids]

    def reload_weights(self, path=None) -> str:
        """Load the weights again (changed files, or another folder of the same architecture).

        The prefix cache starts empty; requests in flight keep their tokens and are recomputed
        with the new weights.  Returns the new fingerprint.
        """
        with self.lock:
            if not isinstance(self.executor, LocalExecutor):
                raise NotImplementedError("reload_weights with pipeline stages or tensor parallelism")
            if path is not None:
                self.model_path = Path(path)
            self._load(load_weights(self.model_path))
            for seq in self.requests.values():  # their blocks belonged to the old pool
                seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
                self.scheduler.add(seq)
            return self.fingerprint
