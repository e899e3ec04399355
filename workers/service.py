"""One engine, stepped by a background thread, fed by many task threads.

The stepping thread also builds the engine and runs anything else that
computes with torch (a weight reload): OpenMP keeps a thread team per thread
that starts parallel work, and a process with two teams on a 2-core machine
lets its idle threads sleep, so every small operator waits for one to wake.

Each generate task ``submit``s its job and waits on its ``Handle``; the
stepping thread runs ``engine.step()`` while anything is unfinished, so a job
that arrives mid-batch joins at the next step.  ``cancel`` aborts a job
between steps (its KV blocks are freed by the engine).  Each job has one
incremental detokenizer: it matches stop strings (and tells the engine to
finish the job), produces the stream deltas, and the final text; a job with
``n`` > 1 has one per choice (``Handle.others``) and is done when every choice
is (the engine runs its choices under their own ids).  After every
step the thread publishes the worker's engine stats to Redis and, for jobs
someone is streaming, their new text as deltas on the job's Redis stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import redis
import torch

from pagedq.config.messages import GenerateJob
from pagedq.config.names import Names
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import DEFAULT_TENANT
from pagedq.fleet.placement import load_tokens
from pagedq.store.dispatch import SeatsHeld
from pagedq.store.jobs import read_backlog
from pagedq.store.registry import ModelInfo, register_model
from pagedq.workers.cpu_budget import ThreadBudget
from pagedq.workers.detokenizer import IncrementalDetokenizer
from pagedq.workers.engine.block_manager import BlockManager
from pagedq.workers.engine.executor import ReplicaLostError
from pagedq.workers.engine.llm_engine import RequestOutput, choice_ids
from pagedq.workers.llm import LLM, Generation, feed, finish
from pagedq.workers.metrics import EngineMetrics

log = logging.getLogger(__name__)

IDLE_PUBLISH_S = 2.0
CACHE_RESYNC_S = 60.0  # the prefix cache's set in Redis is rewritten whole at least this often (placement)
SLOW_STEP_S = 2.0  # a step that takes longer is logged (INFO) with what it computed
MAX_FAILED_STEPS = 3  # engine steps failing in a row (not a request's own failure) before the worker gives up
WEIGHTS_REFRESH_S = 10.0  # how often the engine's fair order re-reads the tenants' weights
HOLD_FLOOR_GAPS = 2  # a step hold may always last this many ``step_hold_s`` (``_hold_for_more``)


def model_info(engine: LLM, names: Names) -> ModelInfo:
    """What a worker registers for its model (the result cache keys on the fingerprint)."""
    return ModelInfo(engine.model_name, engine.fingerprint, engine.max_model_len, engine.cfg.vocab_size,
                     names.generate_queue(engine.model_name), str(engine.model_path),
                     block_size=engine.engine.config.block_size)


@dataclass
class Choice:
    """One of a job's other answers (``n`` > 1): its detokenizer and, once done, its output."""

    detokenizer: IncrementalDetokenizer
    output: Generation | None = None


@dataclass
class Handle:
    job: GenerateJob
    params: SamplingParams
    task_id: str
    detokenizer: IncrementalDetokenizer
    done: threading.Event = field(default_factory=threading.Event)
    output: Generation | None = None  # the final output and text, once done
    num_tokens: int = 0
    stream: bool = False
    cancel_requested: bool = False
    original: Handle | None = None  # for a duplicate: the handle of the copy running here
    requeue: bool = False  # aborted because the worker is shutting down
    lost: bool = False  # ... because a process of its replica died
    duplicate: bool = False  # the job is already running here under another task
    finished_step: int | None = None
    error: str | None = None
    epoch: int | None = None  # the job's epoch as this worker took it: the fence of its finish/requeue
    others: dict[str, Choice] = field(default_factory=dict)  # engine request id -> choice 1.., in order

    @property
    def seats(self) -> int:
        """Engine sequences the job holds: one per choice."""
        return 1 + len(self.others)

    @property
    def generated_tokens(self) -> int:
        """Output tokens of every choice that has finished."""
        outs = [self.output, *(c.output for c in self.others.values())]
        return sum(len(o.output_token_ids) for o in outs if o is not None)

    @property
    def complete(self) -> bool:
        """Done with the engine: the job failed, choice 0 ended by abort or error (its other choices are of no
        use), or every choice has its final output."""
        if self.error is not None:
            return True
        if self.output is None:
            return False
        return self.output.finish_reason in ("abort", "error") or \
            all(c.output is not None for c in self.others.values())


class EngineService:
    def __init__(self, make_engine: Callable[[], LLM], client: redis.Redis, names: Names, hostname: str,
                 result_ttl_s: int = 3600, on_replica_lost=None, worker_ttl_s: int = 15,
                 thread_budget: ThreadBudget | None = None, publish_cache: bool = False,
                 step_hold_s: float = 0.0) -> None:
        self._make_engine = make_engine
        self.publish_cache = publish_cache  # keep names.kv_blocks in step with the prefix cache (placement)
        self._cache_pool: BlockManager | None = None  # the pool whose cache the set holds whole, or None
        self._cache_written_at = 0.0
        self.thread_budget = thread_budget  # None: the thread count stays as configured
        self.engine: LLM | None = None  # built by the stepping thread in ``start``
        self._calls: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        self.on_replica_lost = on_replica_lost  # called once the jobs are handed back (the worker stops)
        self.result_ttl_s = result_ttl_s  # a delta stream lives as long as the result
        self.worker_ttl_s = worker_ttl_s  # the worker's Redis record outlives it by at most this
        self.r = client
        self.names = names
        self.hostname = hostname
        self.handles: dict[str, Handle] = {}
        self.choices: dict[str, Handle] = {}  # engine request id of a job's other choice -> the job's handle
        self._seats_in_use = 0  # sum of handle.seats over self.handles, kept in step under self._lock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._last_publish = 0.0
        self.jobs_received = 0  # generate tasks taken since start
        self.replica_lost = False
        self._failed_steps = 0
        self.metrics = EngineMetrics()  # gpu_worker sets PrometheusEngineMetrics when metrics are on
        # Called after a job leaves the engine (False), and when the worker starts to drain (True: wake everyone).
        self.on_seat_freed: Callable[[bool], None] | None = None
        self._weights_read_at = -WEIGHTS_REFRESH_S
        self.step_hold_s = step_hold_s  # the quiet gap that ends a hold (``_hold_for_more``); 0: no hold
        self._last_arrival = 0.0  # monotonic time of the last submit
        self._arrival_gap = float("inf")  # seconds between the last two submits
        self._arrived_tokens = 0  # prompt tokens submitted since the last step began (still in the engine's inbox)
        self._arrived_jobs = 0  # jobs submitted since the last step began
        self._last_prefill_jobs = 0  # jobs the last step with nothing to decode took in
        self._last_prefill_s: float | None = None  # wall time of the last step with nothing to decode
        self._last_model = ""  # the model the last job named (its backlog: ``_more_on_the_way``)

    # --- called from task / control threads --------------------------------
    def start(self) -> LLM:
        """Start the stepping thread; returns once it has built the engine (or raises what building raised)."""
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="engine-step", daemon=True)
        self._thread.start()
        return built.result()

    def call(self, fn: Callable):
        """Run ``fn()`` on the stepping thread between two steps; returns its result."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine's stepping thread has stopped")
        done: Future = Future()
        self._calls.put((fn, done))
        self._wake.set()
        return done.result()

    def submit(self, job: GenerateJob, task_id: str) -> Handle:
        """Add a job to the engine (raises RequestError); the engine sees it at its next step."""
        params = job.params
        def detokenizer() -> IncrementalDetokenizer:
            return IncrementalDetokenizer(self.engine.tokenizer, params.stop, params.include_stop_str_in_output)
        handle = Handle(job, params, task_id, detokenizer(), stream=job.stream,
                        others={cid: Choice(detokenizer()) for cid in choice_ids(job.job_id, params.n)})
        self._read_weights()  # outside the lock: a slow broker never holds up the stepping thread
        # Compiled on this task thread, outside the lock: a slow schema never holds up the stepping thread.
        grammar = self.engine.grammar_for(params)
        choice_grammars = [self.engine.grammar_for(params) for _ in handle.others]
        with self._lock:
            if job.job_id in self.handles:  # a redelivered copy of a job running here: ends with the original
                handle.duplicate = True
                handle.original = self.handles[job.job_id]
                handle.done = handle.original.done
                return handle
            if self._stopping.is_set():
                handle.requeue = True
                handle.done.set()
                return handle
            self.handles[job.job_id] = handle  # before the engine can produce output for it
            self._seats_in_use += handle.seats
            self.choices.update(dict.fromkeys(handle.others, handle))
            self.metrics.added(job.job_id, job.meta.tenant)
            self.jobs_received += 1
            try:
                self.engine.add_request(job.job_id, job.prompt_token_ids, params, job.priority, job.meta,
                                        grammar=grammar, choice_grammars=choice_grammars)
            except Exception:
                del self.handles[job.job_id]
                self._seats_in_use -= handle.seats
                for cid in handle.others:
                    del self.choices[cid]
                raise
            self._note_arrival(len(job.prompt_token_ids) * handle.seats, job.model)
        return handle

    def _note_arrival(self, prompt_tokens: int, model: str) -> None:
        """For the step hold: what arrived since the last step began, when the last job came, how long after
        the one before, and of which model; wake the stepper."""
        self._last_model = model
        self._arrived_tokens += prompt_tokens
        self._arrived_jobs += 1
        now = time.monotonic()
        self._arrival_gap, self._last_arrival = now - self._last_arrival, now
        self._wake.set()

    def _read_weights(self) -> None:
        """The tenants' weights (``names.tenant_weights``, written by producers) for the engine's fair order;
        read at most every ``WEIGHTS_REFRESH_S``, kept as they were when Redis does not answer."""
        if time.monotonic() - self._weights_read_at < WEIGHTS_REFRESH_S:
            return
        self._weights_read_at = time.monotonic()
        try:
            raw = self.r.hgetall(self.names.tenant_weights)
        except redis.RedisError:
            return
        weights = {}
        for tenant, value in raw.items():
            try:
                if float(value) > 0:
                    weights[tenant] = float(value)
            except ValueError:
                continue
        self.engine.scheduler.counters.weights = weights  # one assignment: the stepping thread sees old or new

    def cancel(self, job_id: str) -> bool:
        with self._lock:
            handle = self.handles.get(job_id)
            if handle is None or handle.cancel_requested:
                return False
            handle.cancel_requested = True
            self._abort(handle)
        self._wake.set()
        log.info("cancelling %s (engine step %d)", job_id, self.engine.stats.steps)
        return True

    def reload(self) -> str:
        """Reload the model's weights from its folder and register the new fingerprint."""
        fingerprint = self.call(self.engine.reload_weights)
        register_model(self.r, self.names, model_info(self.engine, self.names))
        self._publish_stats()
        log.info("reloaded %s: fingerprint %s", self.engine.model_name, fingerprint[:12])
        return fingerprint

    def enable_stream(self, job_id: str) -> None:
        handle = self.handles.get(job_id)
        if handle is not None:
            handle.stream = True

    def snapshot(self) -> list[Handle]:
        with self._lock:
            return list(self.handles.values())

    @property
    def draining(self) -> bool:
        """The worker takes no new jobs (``drain``, ``shutdown``)."""
        return self._stopping.is_set()

    def free_seats(self) -> int:
        """Jobs the engine could take now without any waiting: ``max_num_seqs`` less the sequences its jobs
        hold (running or waiting; a job with ``n`` choices holds n); 0 while the worker drains.  O(1), no lock,
        no engine call: fair dispatch checks it before each claim and at each wake-up of a waiting token."""
        if self._stopping.is_set() or self.engine is None:
            return 0
        return self.engine.engine.config.max_num_seqs - self._seats_in_use

    def seats_held(self) -> SeatsHeld | None:
        """The engine's seats and how many of its jobs each tenant holds, for a claim beyond the seats
        (``FairDispatch.claim``); None while the worker drains."""
        if self._stopping.is_set() or self.engine is None:
            return None
        with self._lock:
            handles = list(self.handles.values())
        jobs = [h.job for h in handles]
        held: Counter[str] = Counter()
        for h in handles:  # a job with n choices holds n seats
            held[h.job.meta.tenant or DEFAULT_TENANT] += h.seats
        return SeatsHeld(self.engine.engine.config.max_num_seqs, dict(held),
                         min((int(j.priority) for j in jobs), default=0))

    def drain(self, timeout_s: float) -> None:
        """Take no new jobs; let running ones finish for up to ``timeout_s``, then ``shutdown``."""
        with self._lock:
            self._stopping.set()
        if self.on_seat_freed is not None:
            self.on_seat_freed(True)  # tokens waiting for a seat hand themselves on now
        if timeout_s <= 0 or not self.handles:
            self.shutdown()
            return
        log.info("draining: %d job(s) running, %.0f s to finish", len(self.handles), timeout_s)
        timer = threading.Timer(timeout_s, self.shutdown)
        timer.daemon = True
        timer.start()

    def shutdown(self) -> None:
        """Abort every job (their tasks requeue them) and stop stepping."""
        with self._lock:
            self._stopping.set()
            for handle in self.handles.values():
                handle.requeue = True
                self._abort(handle)
        self._wake.set()
        if self.on_seat_freed is not None:
            self.on_seat_freed(True)

    # --- the stepping thread -------------------------------------------------
    def _run(self, built: Future) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            built.set_exception(e)
            return
        built.set_result(self.engine)
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - no job may wait on a thread that is gone: hand them all back
            log.exception("the engine's stepping thread failed")
            self._replica_lost(ReplicaLostError(f"the stepping thread failed: {type(e).__name__}: {e}"))

    def _run_calls(self) -> None:
        while True:
            try:
                fn, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(fn())
            except Exception as e:  # noqa: BLE001 - handed to call()'s caller
                done.set_exception(e)

    def _loop(self) -> None:
        while True:
            self._run_calls()
            if not self.engine.has_unfinished():
                if not self.engine.healthy():
                    self._replica_lost(ReplicaLostError("a process of the replica exited"))
                    return
                if self._stopping.is_set():
                    self._release_all()
                    return
                if time.monotonic() - self._last_publish > IDLE_PUBLISH_S:
                    self._publish_stats()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            if self.thread_budget is not None and (n := self.thread_budget.plan()) != torch.get_num_threads():
                log.info("computing with %d thread(s): other processes use the rest", n)
                torch.set_num_threads(n)
            prefill_only = self._hold_for_more()
            self._begin_step(prefill_only)
            stats = self.engine.engine.stats
            started, before = time.monotonic(), (stats.prompt_tokens_computed, stats.generated_tokens)
            try:
                outputs = self.engine.step()
            except ReplicaLostError as e:
                self._replica_lost(e)
                return
            except Exception as e:  # noqa: BLE001 - outside any request's step: the engine's state is unknown
                self._failed_steps += 1
                log.exception("engine step failed (%d in a row)", self._failed_steps)
                if self._failed_steps >= MAX_FAILED_STEPS:  # a broken worker: give the jobs back and exit
                    self._replica_lost(ReplicaLostError(f"{self._failed_steps} engine steps failed in a row"))
                    return
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                continue
            self._failed_steps = 0
            if prefill_only:
                self._last_prefill_s = time.monotonic() - started
            self._log_slow_step(time.monotonic() - started, before)
            self._dispatch(outputs)

    def _begin_step(self, prefill_only: bool) -> None:
        """The step about to run takes the engine's inbox in: note how many jobs a step with nothing to decode
        took (the step hold's sign of a backlog), and count arrivals afresh."""
        if prefill_only:
            self._last_prefill_jobs = self._arrived_jobs
        self._arrived_tokens = self._arrived_jobs = 0

    def _hold_for_more(self) -> bool:
        """Before a step with nothing to decode, wait for more jobs while fewer prompt tokens wait than a step
        takes and jobs keep arriving (each within ``step_hold_s`` of the one before), for at most half the last
        such step's time.  Returns whether the step has nothing to decode.

        Why: a backlog of short jobs reaches the engine as fast as the CPU worker (niced, sharing the cores)
        tokenizes them; stepping on each trickle gives many small steps, each paying a step's fixed cost, and
        leaves the tokenizer less CPU still.  A step with sequences decoding never waits, nor does a lone job:
        one that came more than ``step_hold_s`` after the one before, when the last such step took in one job
        or none (one client waiting for each answer before sending the next would otherwise pay the hold on
        every job; in a backlog the CPU worker may be held off the cores that long, and its steps take in many),
        unless more of its model's jobs are on their way (the first of a batch submitted at once: stepping on it
        alone, with the CPU worker tokenizing the rest on the same cores, costs a step many times a lone one's).
        A hold may last ``HOLD_FLOOR_GAPS`` quiet gaps even when the last such step was quicker than that (one
        job's, before a batch)."""
        sched = self.engine.engine.scheduler
        if sched.running:
            return False
        if self.step_hold_s <= 0 or self._last_prefill_s is None:
            return True
        if self._arrival_gap > self.step_hold_s and self._last_prefill_jobs <= 1 and not self._more_on_the_way():
            return True
        deadline = time.monotonic() + max(self._last_prefill_s / 2, HOLD_FLOOR_GAPS * self.step_hold_s)
        while sched.waiting_prompt_tokens() + self._arrived_tokens < sched.max_num_batched_tokens \
                and self._calls.empty() and not self._stopping.is_set():
            now = time.monotonic()
            wait = min(self._last_arrival + self.step_hold_s, deadline) - now
            if wait <= 0:
                break
            self._wake.clear()
            self._wake.wait(wait)
        return True

    def _more_on_the_way(self) -> bool:
        """Whether the backlog of the last job's model (jobs accepted and not ended, ``names.backlog``) holds
        more jobs than this engine: some are still being tokenized, or queued.  False when Redis does not
        answer (the job steps at once, as a lone one)."""
        try:
            return read_backlog(self.r, self.names, self._last_model) > len(self.handles)
        except (redis.RedisError, ValueError):
            return False

    def _log_slow_step(self, took_s: float, before: tuple[int, int]) -> None:
        """One line per step slower than ``SLOW_STEP_S``: what it computed (``before``: the prompt and generated
        token counters when it started), and with how many threads."""
        if took_s < SLOW_STEP_S:
            return
        now, sched = self.engine.engine.stats, self.engine.engine.scheduler
        log.info("slow engine step %d: %.2f s, %d thread(s), %d prompt + %d generated tokens, %d running, "
                 "%d waiting", now.steps, took_s, torch.get_num_threads(), now.prompt_tokens_computed - before[0],
                 now.generated_tokens - before[1], len(sched.running), len(sched.waiting))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        pipe = self.r.pipeline(transaction=False)
        step = self.engine.stats.steps
        done: list[Handle] = []
        for out in outputs:
            handle = self.handles.get(out.request_id)
            if handle is None:
                if (owner := self.choices.get(out.request_id)) is not None:
                    self._choice_output(owner, out, done)
                continue
            handle.num_tokens = len(out.output_token_ids)
            try:
                if handle.stream or handle.detokenizer.stop:
                    feed(handle.detokenizer, out, self.engine.engine)
                if out.finished:
                    handle.output, handle.finished_step = finish(handle.detokenizer, out), step
                if handle.stream:
                    self._stream_delta(pipe, handle, out.finished)
            except Exception as e:  # noqa: BLE001 - one request's text fails it alone
                log.exception("detokenizing job %s failed", out.request_id)
                handle.error = f"detokenizing failed: {type(e).__name__}: {e}"
                if not out.finished:
                    self.engine.abort_request(out.request_id)
                out.finished = True  # released below; its task fails the job with the error
            if out.finished:
                if handle.error is not None or out.finish_reason in ("abort", "error"):
                    self._abort(handle, others_only=True)  # its other choices have no use now
                done.append(handle)
        self.metrics.step(self.engine, outputs)
        # their seats are released just below, once the pipe (their last deltas) is in Redis: placement must
        # see them free now, or a worker that just finished looks full until its next idle publish
        self._publish_stats(pipe=pipe, freeing=sum(h.seats for h in {id(h): h for h in done}.values() if h.complete))
        try:
            pipe.execute()
        except redis.RedisError as e:
            self.publish_failed()
            log.warning("could not publish step stats / deltas: %s", e)
        for handle in done:
            if handle.complete:
                self._release(handle.job.job_id)

    def _choice_output(self, handle: Handle, out: RequestOutput, done: list[Handle]) -> None:
        """An output of one of a job's other choices (``n`` > 1)."""
        choice = handle.others[out.request_id]
        try:
            if choice.detokenizer.stop:
                feed(choice.detokenizer, out, self.engine.engine)
            if out.finished:
                choice.output = finish(choice.detokenizer, out)
                done.append(handle)
        except Exception as e:  # noqa: BLE001 - fails its job, like the job's own text
            log.exception("detokenizing choice %s failed", out.request_id)
            handle.error = f"detokenizing failed: {type(e).__name__}: {e}"
            self._abort(handle)
            done.append(handle)

    def _abort(self, handle: Handle, others_only: bool = False) -> None:
        """Abort a job's engine requests (choice 0's unless ``others_only``, and the other choices')."""
        for request_id in ([] if others_only else [handle.job.job_id]) + list(handle.others):
            self.engine.abort_request(request_id)

    def _replica_lost(self, error: ReplicaLostError) -> None:
        """A stage process of the engine died: every job goes back to the queue, and the worker stops."""
        log.error("replica lost (%s): requeueing %d job(s), taking no more work", error, len(self.handles))
        self.replica_lost = True
        for handle in self.snapshot():
            handle.lost = True
        self.shutdown()
        self._release_all()
        if self.on_replica_lost is not None:
            self.on_replica_lost()

    def _release(self, job_id: str) -> None:
        with self._lock:
            handle = self.handles.pop(job_id, None)
            if handle is not None:
                self._seats_in_use -= handle.seats
            for cid in handle.others if handle is not None else ():
                self.choices.pop(cid, None)
        if handle is not None:
            self.metrics.released(handle)
            handle.done.set()
            if self.on_seat_freed is not None:
                self.on_seat_freed(False)

    def _release_all(self) -> None:
        for handle in self.snapshot():
            self._release(handle.job.job_id)

    def _fail_all(self, error: str) -> None:
        for handle in self.snapshot():
            handle.error = error
            self._abort(handle)
            self._release(handle.job.job_id)

    def _stream_delta(self, pipe, handle: Handle, finished: bool) -> None:
        delta = handle.detokenizer.delta(finished)
        if delta:
            key = self.names.stream(handle.job.job_id)
            pipe.xadd(key, {"type": "delta", "text": delta, "tokens": handle.num_tokens},
                      maxlen=self.names.stream_maxlen, approximate=True)
            pipe.expire(key, self.result_ttl_s)

    def _publish_stats(self, pipe=None, freeing: int = 0) -> None:
        """The worker's record (and, with placement, its load and prefix cache); ``freeing``: seats of jobs
        that finished this step, released after the publish."""
        self._last_publish = time.monotonic()
        e = self.engine
        stats = {"steps": e.stats.steps, "free_blocks": e.block_manager.num_free_blocks,
                 "used_blocks": e.block_manager.num_used_blocks, "num_blocks": e.block_manager.num_blocks,
                 "requests": e.num_requests, "inflight": len(self.handles), "preemptions": e.stats.preemptions,
                 "generated_tokens": e.stats.generated_tokens, "jobs_received": self.jobs_received,
                 "fingerprint": e.fingerprint, "prefix_hits": e.stats.prefix_hits,
                 "prompt_tokens_computed": e.stats.prompt_tokens_computed, "updated_at": time.time()}
        stats.update(self.metrics.record_fields(e))
        target = pipe if pipe is not None else self.r.pipeline(transaction=False)
        key = self.names.worker(self.hostname)
        target.hset(key, mapping=stats)
        target.expire(key, self.worker_ttl_s)
        if self.publish_cache:
            target.hset(key, mapping=self._placement_fields(freeing))
            target.sadd(self.names.placement_workers(e.model_name), self.hostname)
            self._publish_cache(target)
        if pipe is None:
            try:
                target.execute()
            except redis.RedisError as err:
                self.publish_failed()
                log.warning("could not publish worker stats: %s", err)

    def _placement_fields(self, freeing: int = 0) -> dict:
        """What placement weighs besides the cache (``fleet.placement``): free seats and the load in tokens; the
        tokens claims added since the last publish (``claimed_tokens``) are in the load now, or soon."""
        held = [(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0),
                 max(seq.params.max_output_tokens - seq.num_output_tokens, 0))
                for seq in list(self.engine.engine.requests.values())]
        free = 0 if self.draining else self.free_seats() + freeing  # a draining worker is never preferred
        return {"free_seats": free, "load_tokens": load_tokens(held), "claimed_tokens": 0}

    def _publish_cache(self, pipe) -> None:
        """The prefix cache's block names into ``names.kv_blocks``: the whole set when the pool is new (start,
        reload: new weights name every block anew), after a publish failed, and every ``CACHE_RESYNC_S`` (a
        Redis that restarted lost it); else each step's changes.  Same TTL as the worker's record (the heartbeat
        refreshes both, ``run_celery_worker``'s ``keep_alive``), so a dead worker's set goes with it.

        The whole set is built under a staging name and renamed over the old one: a claim (another connection)
        sees the old set or the new, never an empty one between a DEL and an SADD of many blocks."""
        pool = self.engine.block_manager
        key = self.names.kv_blocks(self.engine.model_name, self.hostname)
        if pool is not self._cache_pool or time.monotonic() - self._cache_written_at > CACHE_RESYNC_S:
            pool.track_changes()
            self._cache_pool, self._cache_written_at = pool, time.monotonic()
            if not pool.cached:
                pipe.delete(key)
                return
            staging = self.names.kv_blocks_staging(self.engine.model_name, self.hostname)
            pipe.delete(staging)
            pipe.sadd(staging, *(h.hex() for h in pool.cached))
            pipe.expire(staging, self.worker_ttl_s)
            pipe.rename(staging, key)  # keeps the TTL
            return
        cached, evicted = pool.take_changes()
        if evicted:
            pipe.srem(key, *(h.hex() for h in evicted))
        if cached:
            pipe.sadd(key, *(h.hex() for h in cached))
        pipe.expire(key, self.worker_ttl_s)

    def publish_failed(self) -> None:
        """A step's publish did not reach Redis: the next one writes the cache's set whole."""
        self._cache_pool = None
