"""``pagedq worker``: the Celery GPU worker, one engine serving one model's queue.

``run_worker`` loads the model once (on the engine's stepping thread),
registers it in Redis, then runs a Celery worker on the model's queue with a
threads pool of ``worker_max_inflight`` (prefetch 1 each): that many generate
tasks are in flight at once, all feeding the one engine.  Any number of
these, on any hosts, may consume the same model queue.

- ``dispatch`` (queue ``pagedq.generate.<model>``, and the worker's own queue
  for placement nudges): a token for "a job of this model".  Every generate
  job waits in its model's fair queue (``store/dispatch.py``); a token waits
  (at most ``ROOM_WAIT_S``) until the engine has a free seat, then claims the
  next job in the fleet order (priority band, the least-served tenant by
  weighted tokens, deadline, arrival) with cache-aware placement
  (``fleet.placement``: a job another worker holds more of is left to it for a
  bounded time), admits it (in_progress, one more attempt), hands it to the
  engine, waits, then sends the Completion to postprocess by task name.  With
  no room the token goes back to its queue for a worker that has some; with
  nothing to claim it ends.  With every seat taken, a token still claims a
  job that may take a running job's seat: one of a higher band, or of a
  tenant holding fewer seats here than its share (``fleet.policy.seat_share``);
  the engine preempts for it, and the preempted job waits in the engine for
  the next free seat.  The worker holds ``max_num_seqs`` + ``swap_room`` (half
  the seats: the jobs it may hold beyond its seats) + ``LOOKAHEAD`` tasks: the
  job it runs next is chosen when a seat is free.  A cancelled job ends here;
  a job aborted by a worker shutdown goes back to its fair queue and its token
  back on its queue.
- ``generate`` (same queue): a job message from a producer of before the one
  dispatch path (an upgrade with jobs in flight): the job joins its model's
  fair queue, with a token, and runs as every other job.
- ``ProgressReporter``: every ``progress_interval_s``, a ``task-progress``
  event (tokens so far) per running task, which Flower shows as the task's
  PROGRESS state, and the same count in the job record; it also re-checks
  the running jobs' records, so a cancel whose message this worker missed
  still lands within an interval.
- ``ControlListener``: signed cancel / stream / reload requests published by
  clients, each acted on once (``store/control.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import redis
import torch
from celery import Celery, signals
from celery.exceptions import Reject

from pagedq.config import Settings
from pagedq.config.celery_app import DispatchToken, make_celery, send_dispatch_token
from pagedq.config.messages import (
    ChoiceOutput,
    Completion,
    GenerateJob,
    JobNotCompleted,
    MalformedMessageError,
    PromptScores,
    RequestError,
    parse_message,
    to_json,
)
from pagedq.config.names import (
    DISPATCH_TASK,
    GENERATE_TASK,
    POSTPROCESS_TASK,
    JobState,
    Names,
    broker_priority,
)
from pagedq.config.scheduling import DEFAULT_TENANT
from pagedq.config.served import served_names
from pagedq.fleet.placement import PlacementPolicy
from pagedq.store import control
from pagedq.store.connection import broker_url, redis_client, through_outage
from pagedq.store.dispatch import FairDispatch, SeatsHeld, Skip, SlotBusy
from pagedq.store.jobs import JobStore
from pagedq.store.model_names import register_served_names
from pagedq.store.registry import gpu_workers_serving, register_model
from pagedq.workers.celery_worker import run_celery_worker, sent_events
from pagedq.workers.cpu_budget import ThreadBudget
from pagedq.workers.llm import LLM
from pagedq.workers.metrics import engine_metrics
from pagedq.workers.processes import worker_hostname
from pagedq.workers.service import EngineService, Handle, model_info

log = logging.getLogger(__name__)


def parse_generate(payload, task_id: str) -> GenerateJob:
    try:
        return parse_message(GenerateJob, payload)
    except MalformedMessageError as e:
        log.error("generate task %s: dropped a malformed message: %s", task_id, e)
        raise Reject(f"malformed message: {e}", requeue=False) from None


def register_generate(app: Celery, fair: FairDispatch):
    """Jobs sent as a whole ``generate`` message (producers and CPU workers of before the one dispatch path):
    each joins its model's fair queue and gets a token, pushed before the message is acknowledged (a kill in
    between pushes it again: ``push`` is idempotent, and a spare token finds nothing)."""
    @app.task(name=GENERATE_TASK, bind=True)
    def generate(self, payload):
        job = parse_generate(payload, self.request.id)
        fair.push(job)
        send_dispatch_token(self.app, job.model, job.priority, event_dispatcher=sent_events(),
                            tenant=job.meta.tenant or DEFAULT_TENANT)
        return {"job_id": job.job_id, "queued": "fair queue"}

    return generate


def start(job: GenerateJob, request, service: EngineService, store: JobStore, names: Names) -> tuple[Handle, str]:
    """Admit a job (in_progress, one more attempt) and hand it to the engine; returns its handle and the weights'
    fingerprint before it could be stepped.  A job that may not run (cancelled, expired, poison, refused by the
    engine) ends here: raises JobNotCompleted."""
    verdict = store.admit(job.job_id, worker=request.hostname)
    if verdict != "ok":
        service.metrics.settled(verdict)
        store.settle(job.job_id, verdict)
        raise JobNotCompleted(f"job {job.job_id} {store.state(job.job_id)} before generating")
    service.metrics.admitted(job.job_id, verdict.created_at, verdict.attempts)  # latencies; redeliveries
    weights = service.engine.fingerprint  # read before the engine can step the job (see conclude)
    try:
        handle = service.submit(job, request.id)
    except RequestError as e:
        service.metrics.ended(job.job_id, "failed")
        store.finish(job.job_id, JobState.FAILED, error=e.to_dict(), fence=verdict.epoch)
        raise JobNotCompleted(f"job {job.job_id} failed: {e.code}: {e}") from None
    handle.epoch = verdict.epoch  # a worker the job is taken from since ends nothing (store/jobs.py: fencing)
    # Cancel or stream requests published before the job was registered here left their flag on the record.
    state, stream = store.r.hmget(names.job(job.job_id), "state", "stream")
    if state == JobState.CANCELLING:
        service.cancel(job.job_id)
    if stream == "1":
        service.enable_stream(job.job_id)
    return handle, weights


LOOKAHEAD = 4  # dispatch tokens a worker holds beyond its engine's seats, each waiting for one to free
ROOM_WAIT_S = 1.0  # how long a token waits for a free seat before it goes back to its queue (x waiting / LOOKAHEAD)


def swap_room(max_num_seqs: int) -> int:
    """Jobs a worker may hold beyond its seats, each claimed to take a running job's seat (a tenant's share is
    at most half the seats once a second tenant holds any)."""
    return max_num_seqs // 2


class Seats:
    """The engine's free seats as dispatch tokens see them: a token reserves one before it claims a job, so
    that N free seats are claimed at most N times however many tokens wait (the engine's own count only
    moves once the claimed job is submitted).  Invariant: jobs held by the engine + reserved <= max_num_seqs,
    plus at most ``swap_room`` jobs claimed beyond the seats (``claim_beyond``: each takes a running job's seat).

    Tokens waiting for a seat time out, together, about ``LOOKAHEAD`` times per ``timeout_s`` however many
    wait (each waits ``timeout_s`` x waiting / ``LOOKAHEAD``): each time-out looks for a job that may take a
    seat, then hands its token on, so a full worker neither churns its tokens nor stops looking.

    Waiters sleep until the engine releases a job or starts to drain (``EngineService.on_seat_freed``), not on
    a short poll: a worker holds ~100 waiting tokens, and waking each every few milliseconds took CPU and the GIL
    from the engine (one-token jobs ran ~20% slower with fair dispatch).  ``POLL_S`` is only a safety net: every
    change that can let a waiter in (a job released, a reservation given back, a drain) notifies."""

    POLL_S = 5.0

    def __init__(self, service: EngineService) -> None:
        self.service = service
        service.on_seat_freed = self.freed
        self.reserved = 0
        self.waiting = 0  # tokens inside reserve()
        self.beyond = threading.Lock()  # held from a claim beyond the seats until its job is in the engine
        self._cond = threading.Condition()

    def reserve(self, timeout_s: float) -> bool:
        """Take a free seat, waiting for one (``timeout_s``, scaled as the class says); False if none freed (or
        the worker drains)."""
        with self._cond:
            self.waiting += 1
            try:
                deadline = time.monotonic() + timeout_s * max(1.0, self.waiting / LOOKAHEAD)
                while self.service.free_seats() - self.reserved <= 0:
                    left = deadline - time.monotonic()
                    if left <= 0 or self.service.draining:
                        return False
                    self._cond.wait(min(left, self.POLL_S))  # woken when a job leaves the engine (freed)
                self.reserved += 1
                return True
            finally:
                self.waiting -= 1

    def unreserve(self) -> None:
        """The seat was used (its job is in the engine now) or not needed (nothing to claim)."""
        with self._cond:
            self.reserved -= 1
            self._cond.notify()

    def freed(self, everyone: bool = False) -> None:
        with self._cond:
            if everyone:
                self._cond.notify_all()
            else:
                self._cond.notify()


class BoundJobs:
    """Tokens that bound a job since the last progress report: ``ProgressReporter`` tells Flower (a
    ``task-progress`` event each, the task's Result field naming the job) in its next buffered message.  Sent
    by the dispatch task itself, each cost a new event dispatcher and a broker publish per job.  A token that
    ended before the report is left out: an event after its task-succeeded would overwrite Flower's result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}  # task id -> job id

    def add(self, task_id: str, job_id: str) -> None:
        with self._lock:
            self._pending[task_id] = job_id

    def discard(self, task_id: str) -> None:
        with self._lock:
            self._pending.pop(task_id, None)

    def take(self) -> list[tuple[str, str]]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return list(pending.items())


class Peers:
    """Whether another live GPU worker serves this worker's model, read from the worker records at most every
    ``TTL_S`` (a worker started later is seen within that): a token a full worker times out on is handed on
    only if some other worker could take it."""

    TTL_S = 5.0

    def __init__(self, r: redis.Redis, names: Names, model: str, hostname: str) -> None:
        self.r, self.names, self.model, self.hostname = r, names, model, hostname
        self._others = False
        self._until = 0.0

    def any_other(self) -> bool:
        now = time.monotonic()
        if now >= self._until:  # two threads may both read: harmless
            self._others = bool(gpu_workers_serving(self.r, self.names, self.model) - {self.hostname})
            self._until = now + self.TTL_S
        return self._others


SKIP_RETRY_MIN_S = 0.02  # the least wait between two placed claims of a worker after a skip


@dataclass
class Placement:
    """A worker's placed claims: one at a time (``gate``), none before ``next_try``."""

    policy: PlacementPolicy
    gate: threading.Lock = field(default_factory=threading.Lock)
    next_try: float = 0.0


@dataclass
class Dispatch:
    """What the dispatch task needs besides the engine: the fair queues, this worker's seats, and the tokens
    that bound a job (for Flower), and whether other workers serve the model."""

    fair: FairDispatch
    seats: Seats
    peers: Peers
    placement: Placement
    room_wait_s: float = ROOM_WAIT_S
    bound: BoundJobs = field(default_factory=BoundJobs)


def sent_for_a_winner(token: DispatchToken, held: SeatsHeld) -> bool:
    """Whether the job ``token`` was sent for might take a running job's seat on a full worker: its band is above
    the lowest running, or another tenant holds a seat here (its tenant may be below its share).  A job that
    could was pushed with a token of its own, so a token whose job could not skips a claim beyond the seats
    that would find nothing.  A token naming no tenant (a spare, an older sender's) might."""
    return token.tenant is None or token.priority > held.lowest_priority or set(held.held) != {token.tenant}


def parse_token(payload, task_id: str) -> DispatchToken:
    try:
        tenant = payload.get("tenant")
        return DispatchToken(str(payload["model"]), str(payload["slot"]), int(payload["priority"]),
                             None if tenant is None else str(tenant))
    except (AttributeError, TypeError, KeyError, ValueError) as e:
        log.error("dispatch task %s: dropped a malformed token: %r", task_id, e)
        raise Reject(f"malformed token: {e!r}", requeue=False) from None


def register_dispatch(app: Celery, service: EngineService, store: JobStore, names: Names, d: Dispatch):
    """The dispatch task: a token binds to the next job of the fair queue when this engine has room."""
    slots: dict[str, str] = {}  # slot -> the job a token of this worker runs under it

    @app.task(name=DISPATCH_TASK, bind=True, throws=(JobNotCompleted,))
    def dispatch(self, payload):
        token = parse_token(payload, self.request.id)
        if (here := slots.get(token.slot)) is not None:  # redelivered while its job runs here
            return wait_for_original(token.slot, here)
        try:
            got = next_job(self, token)
        except SlotBusy:  # found by the claim itself: no read of the slot per token
            if (here := slots.get(token.slot)) is not None:  # its original took the slot here meanwhile
                return wait_for_original(token.slot, here)
            d.fair.release(token.slot)  # bound by a holder that is gone (its restore did not release it)
            got = next_job(self, token)
        if isinstance(got, dict):
            return got
        job, reserved = got
        d.bound.add(self.request.id, job.job_id)  # Flower learns it from the next progress report
        slots[token.slot] = job.job_id
        try:
            return run_bound(self, job, token.slot, reserved)
        finally:
            slots.pop(token.slot, None)
            d.bound.discard(self.request.id)

    def next_job(task, token: DispatchToken) -> tuple[GenerateJob, bool] | dict:
        """(the job claimed for ``token``, whether it holds a reserved seat), or the task's result when it
        claims none (nothing waiting, or handed on for lack of room)."""
        job, reserved = take_beyond(token, task.request.hostname), False
        while job is None:
            if d.seats.reserve(d.room_wait_s):
                reserved = True
                try:
                    job = claim(token, task.request.hostname)
                except BaseException:
                    d.seats.unreserve()
                    raise
                if job is None:
                    d.seats.unreserve()
                    return {"slot": token.slot, "job_id": None, "skipped": "no job waiting"}
                if isinstance(job, Skip):  # each waiting job is another worker's for now: ask again soon
                    d.seats.unreserve()
                    job, reserved = None, False
                    continue
                break
            job = take_beyond(token, task.request.hostname, timed_out=True)
            if job is None and (service.draining or d.peers.any_other()):
                # Handed on, to the back of its queue, for a worker with room (or this one, later).  Sent
                # before this one is acknowledged: a kill in between leaves two tokens for one job, and the
                # spare finds nothing.  Not Reject(requeue=True): Celery logs each with a traceback, and a
                # full worker hands on several a second.  With no other worker serving the model the token
                # stays and waits again: handing it on would only bring it back here, a message round trip
                # for nothing.
                # a fresh slot: never two on one
                send_dispatch_token(task.app, token.model, token.priority, event_dispatcher=sent_events(),
                                    tenant=token.tenant)
                return {"slot": token.slot, "job_id": None, "handed_on": "no free seat"}
        return job, reserved

    def claim(token: DispatchToken, worker: str) -> GenerateJob | Skip | None:
        """The next job for a free seat: the first of the fleet order's first jobs this worker may take
        (``fleet.placement``).  Placed claims go one at a time on a worker; after a skip the next waits until a
        job may be stolen (at most ``steal_s``), and the worker the first job prefers gets a token of its own (a
        nudge: a spare, so one lost on a dead worker's queue costs nothing)."""
        model = service.engine.model_name
        with d.placement.gate:
            while (wait := d.placement.next_try - time.monotonic()) > 0 and not service.draining:
                time.sleep(min(wait, 0.05))
            got = d.fair.claim_placed(model, worker, token.slot, d.placement.policy)
            if isinstance(got, Skip):
                d.placement.next_try = time.monotonic() + max(got.retry_in, SKIP_RETRY_MIN_S)
                if got.nudge is not None:
                    send_dispatch_token(app, model, token.priority, queue=names.worker_queue(model, got.nudge))
        return got

    def take_beyond(token: DispatchToken, worker: str, timed_out: bool = False) -> GenerateJob | None:
        """``claim_beyond``, one at a time: with a job it returns holding ``seats.beyond``, which ``run_bound``
        releases once the job is in the engine, so the next claim beyond the seats counts it."""
        d.seats.beyond.acquire()
        try:
            job = claim_beyond(token, worker, timed_out)
        except BaseException:
            d.seats.beyond.release()
            raise
        if job is None:
            d.seats.beyond.release()
        return job

    def claim_beyond(token: DispatchToken, worker: str, timed_out: bool) -> GenerateJob | None:
        """With every seat taken: a job that may take a running job's seat (higher band, or a tenant below its
        share: the engine then preempts; ``fleet.policy.seat_share``), or None.

        A fresh token whose own job could not win (``sent_for_a_winner``) skips the claim; one that timed out
        waiting claims anyway (the safety net, a few times a second per worker)."""
        free = service.free_seats()
        if free - d.seats.reserved > 0 or free <= -swap_room(service.engine.engine.config.max_num_seqs):
            return None  # a seat is free (claim it the usual way), or enough jobs already wait for one
        held = service.seats_held()
        if held is None or not (timed_out or sent_for_a_winner(token, held)):
            return None
        return d.fair.claim(service.engine.model_name, worker, token.slot, held)

    def wait_for_original(slot: str, job_id: str) -> dict:
        """No second run: this copy of the token ends as the running one does (handed back with it on a drain)."""
        original = service.handles.get(job_id)
        if original is not None:
            original.done.wait()
            if original.requeue:
                raise Reject("worker shutting down", requeue=True)
        return {"slot": slot, "job_id": job_id, "skipped": "already running on this worker"}

    def run_bound(task, job: GenerateJob, slot: str, reserved: bool) -> dict:
        try:
            handle, weights = start(job, task.request, service, store, names)
        except JobNotCompleted:
            end_bound(job, slot, 0)
            raise
        finally:
            if reserved:
                d.seats.unreserve()
            else:
                d.seats.beyond.release()
        handle.done.wait()
        if handle.duplicate:  # already running here under another token (a restore released it): ends with it
            if handle.original is None or not handle.original.requeue:
                d.fair.unbind(slot, job.job_id)  # else the Reject below hands the token back and its restore releases the job
            return conclude(task.app, handle, store, names)
        if handle.requeue:  # drain or replica loss: the job back in its fair queue, the token back on its queue
            store.requeue(job.job_id, count_attempt=handle.lost, fence=handle.epoch)
            d.fair.release(slot, fence=handle.epoch)
            raise Reject("worker shutting down", requeue=True)
        generated = handle.generated_tokens
        fingerprint = weights if service.engine.fingerprint == weights else ""
        try:
            summary = through_outage(lambda: conclude(task.app, handle, store, names, fingerprint), f"job {job.job_id}")
        finally:
            end_bound(job, slot, generated, handle.epoch)
        return {**summary, "slot": slot}

    def end_bound(job: GenerateJob, slot: str, generated: int, fence: int | None = None) -> None:
        """The job ended (or was sent to postprocess): forget its binding, give back the output it did not use.
        Fenced: a worker the job was taken from since (it froze past its lease) leaves the slot to the new one."""
        tenant = getattr(getattr(job, "meta", None), "tenant", None) or "default"
        d.fair.unbind(slot, job.job_id, job.model, tenant, max(job.params.max_output_tokens - generated, 0), fence)

    return dispatch


def conclude(app: Celery, handle: Handle, store: JobStore, names: Names, fingerprint: str = "") -> dict:
    """End a job the engine is done with: failed, cancelled, requeued, or its Completion sent to postprocess.

    ``fingerprint``: the weights that computed every one of its tokens (the engine's fingerprint before it
    was submitted and after it finished were the same), else "" (a reload recomputes running jobs with the
    new weights: a mixed answer); the result cache files the answer under it.
    """
    job, out = handle.job, handle.output
    if handle.duplicate:  # a redelivered copy: it ends as the original does, and goes back with it
        if handle.original is not None and handle.original.requeue:
            raise Reject("worker shutting down", requeue=True)
        return {"job_id": job.job_id, "skipped": "already running on this worker"}
    if handle.requeue:
        store.requeue(job.job_id, count_attempt=handle.lost, fence=handle.epoch)
        raise Reject("worker shutting down", requeue=True)
    if handle.error or out is None:
        error = RequestError(handle.error or "no output", code="server_error")
        store.finish(job.job_id, JobState.FAILED, error=error.to_dict(), fence=handle.epoch)
        raise JobNotCompleted(f"job {job.job_id} failed: {error.code}: {error}")
    others = [c.output for c in handle.others.values() if c.output is not None]
    tokens = handle.generated_tokens
    summary = {"job_id": job.job_id, "completion_tokens": tokens, "finish_reason": out.finish_reason}
    failed = next((o for o in [out, *others] if o.finish_reason == "error"), None)
    if failed is not None:  # this request's step raised; its batch mates went on
        error = RequestError(f"the engine failed on this request: {failed.error}", code="engine_error")
        store.finish(job.job_id, JobState.FAILED, error=error.to_dict(), fence=handle.epoch)
        raise JobNotCompleted(f"job {job.job_id} failed: {error.code}: {error}")
    # Cancelled: choice 0 aborted, or (n > 1) a choice was still running when the cancel came.
    if out.finish_reason == "abort" or len(others) < len(handle.others) or \
            any(o.finish_reason == "abort" for o in others):
        store.update(job.job_id, completion_tokens=tokens, aborted_at_step=handle.finished_step)
        store.finish(job.job_id, JobState.CANCELLED, fence=handle.epoch)
        raise JobNotCompleted(f"job {job.job_id} cancelled after {tokens} tokens")
    store.update(job.job_id, completion_tokens=tokens, generated_at=time.time())  # the latency budget's engine end
    completion = Completion(
        request_id=job.job_id, kind=job.kind, model=job.model, text=out.text, output_token_ids=out.output_token_ids,
        num_prompt_tokens=out.num_prompt_tokens, finish_reason=out.finish_reason, stop_reason=out.stop_reason,
        num_cached_tokens=out.num_cached_tokens, logprobs=out.logprobs, want_logprobs=job.params.logprobs,
        fingerprint=fingerprint, tool_parsing=job.tool_parsing, others=[ChoiceOutput.of(o) for o in others],
        epoch=handle.epoch or 0, prompt=PromptScores.of(job.params, job.prompt_token_ids, out.prompt_logprobs))
    app.send_task(POSTPROCESS_TASK, args=[to_json(completion)], priority=broker_priority(job.priority),
                  argsrepr=completion.describe(), kwargsrepr="{}", event_dispatcher=sent_events())
    return summary


class ProgressReporter(threading.Thread):
    def __init__(self, app: Celery, service: EngineService, r: redis.Redis, names: Names, hostname: str,
                 interval_s: float, bound: BoundJobs | None = None) -> None:
        super().__init__(name="progress", daemon=True)
        self.app, self.service, self.r, self.names = app, service, r, names
        self.hostname, self.interval_s = hostname, interval_s
        self.bound = bound or BoundJobs()
        self.reported: dict[str, int] = {}
        self.checked_epoch: object = object()  # names.job_flags_epoch at the last re-check (a sentinel: none yet)

    def run(self) -> None:
        with self.app.connection_for_write() as conn:
            # Buffered: one broker message per report carries every task's event (Flower unpacks the list).
            dispatcher = self.app.events.Dispatcher(conn, hostname=self.hostname, enabled=True,
                                                    buffer_group=["task"], buffer_limit=1 << 30)
            while True:
                time.sleep(self.interval_s)
                try:
                    self.report(dispatcher)
                except Exception as e:  # noqa: BLE001 - progress is best effort
                    log.warning("progress report failed: %s", e)

    def report(self, dispatcher) -> None:
        epoch = self.r.get(self.names.job_flags_epoch)  # before the snapshot: see recheck_cancels
        handles = self.service.snapshot()
        self.recheck_cancels(handles, epoch)
        just_bound = set()
        for task_id, job_id in self.bound.take():
            dispatcher.send("task-progress", uuid=task_id, job_id=job_id, result=f"bound job {job_id}")
            just_bound.add(task_id)  # its token count goes in the next report, after Flower showed this one
        pipe = self.r.pipeline(transaction=False)
        for h in handles:
            if h.num_tokens and h.task_id not in just_bound and self.reported.get(h.task_id) != h.num_tokens:
                self.reported[h.task_id] = h.num_tokens
                # Flower shows the custom state (PROGRESS) and, in the task's Result field, the count.
                # A dispatch token names no job in its arguments: the progress line does.
                result = f"{h.num_tokens} tokens so far (job {h.job.job_id})"
                dispatcher.send("task-progress", uuid=h.task_id, tokens=h.num_tokens, result=result)
                pipe.hset(self.names.job(h.job.job_id), "completion_tokens", h.num_tokens)
        dispatcher.flush()
        pipe.execute()
        live = {h.task_id for h in handles}
        self.reported = {k: v for k, v in self.reported.items() if k in live}

    def recheck_cancels(self, handles: list[Handle], epoch: str | None) -> None:
        """Cancel running jobs whose record says ``cancelling`` (and stream those it marks streamed): a cancel
        lands even if its control message never reached this worker (published while the listener
        reconnected, or signed with another key).

        The records are read only when ``epoch`` (``names.job_flags_epoch``, read before ``handles`` was taken)
        differs from the last re-check's: each flag is written before the epoch moves, so a flag set since the
        last re-check is read now, and one set before it was read by it or, for a job registered since, by
        ``start``'s own read after registering the job.  (Reading every record every interval cost one HMGET per
        held job per interval: ~25 Redis commands a job on ShareGPT-length jobs.)"""
        if epoch == self.checked_epoch:
            return
        running = [h for h in handles if not h.cancel_requested]
        if running:
            pipe = self.r.pipeline(transaction=False)
            for h in running:
                pipe.hmget(self.names.job(h.job.job_id), "state", "stream")
            for h, (state, stream) in zip(running, pipe.execute(), strict=True):
                if state == JobState.CANCELLING and self.service.cancel(h.job.job_id):
                    log.info("cancelling %s: its record says cancelling (re-checked)", h.job.job_id)
                elif stream == "1" and not h.stream:
                    self.service.enable_stream(h.job.job_id)
        self.checked_epoch = epoch


class ControlListener:
    """Signed requests on ``names.control_channel`` (see ``pagedq.store.control``): {"op": "cancel" | "stream",
    "job_id": ...}, or {"op": "reload", "model": ...} (reload the weights; the prefix cache is dropped).
    Unsigned, forged, stale or replayed messages change nothing, are logged and counted (``control_ignored``
    in the worker's record).  A cancel missed here (the listener reconnecting) still lands: see
    ``ProgressReporter.recheck_cancels``."""

    def __init__(self, r: redis.Redis, names: Names, secret: bytes | None, service: EngineService,
                 worker: str | None = None) -> None:
        self.service = service
        self.r, self.names = r, names
        self.worker = worker or getattr(service, "hostname", "")
        self.receiver = control.ControlReceiver(r, names, control.ControlKey(r, names, secret), self.worker)
        self.pubsub = r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(**{names.control_channel: self.on_message})
        self.thread = None

    def start(self) -> None:
        self.thread = self.pubsub.run_in_thread(sleep_time=1.0, daemon=True,
                                                exception_handler=self._on_error)

    def on_message(self, message: dict) -> None:
        try:
            request = self.receiver.accept(message["data"])
            op = request["op"]
            if op == "reload":
                if request["model"] == self.service.engine.model_name:
                    try:
                        self.service.reload()
                    except Exception:  # noqa: BLE001 - a bad folder must not stop the listener
                        log.exception("reloading %s failed; still serving the old weights", request["model"])
                return
            job_id = str(request["job_id"])
        except (ValueError, KeyError, TypeError) as e:
            log.error("ignoring a control message (%s): %.200r", e, message.get("data"))
            self._count_ignored()
            return
        except redis.RedisError as e:  # the seen-set is unreachable: acting could act twice; the cancel re-check
            log.error("ignoring a control message (broker: %s): %.200r", e, message.get("data"))  # still lands
            return
        if op == "cancel":
            self.service.cancel(job_id)
        elif op == "stream":
            self.service.enable_stream(job_id)
        else:
            log.error("ignoring a control message with unknown op %r", op)

    def _count_ignored(self) -> None:
        if self.worker:
            try:
                key = self.names.worker(self.worker)
                if self.r.exists(key):  # never recreate an expired record (without its TTL it would look alive)
                    self.r.hincrby(key, "control_ignored", 1)
            except redis.RedisError:
                pass

    @staticmethod
    def _on_error(exc, pubsub, thread) -> None:
        log.warning("control listener: %s; retrying", exc)  # redis-py resubscribes on reconnect
        time.sleep(1.0)


def thread_budget(settings: Settings) -> ThreadBudget | None:
    """Adapt the thread count to the CPU left free, for a whole model in this process on the CPU, unless the
    thread count is set (``PAGEDQ_NUM_THREADS``) or turned off (``PAGEDQ_ADAPTIVE_THREADS=false``)."""
    one_process = settings.pipeline_stages == 1 and settings.tensor_parallel == 1
    on_cpu = settings.device == "cpu" or (settings.device == "auto" and not torch.cuda.is_available())
    if settings.adaptive_threads and settings.num_threads is None and one_process and on_cpu:
        return ThreadBudget()
    return None


def inflight(settings: Settings) -> int:
    """Tasks one GPU worker holds at once: its seats, the jobs it may hold beyond them and a look-ahead, so the
    rest of the backlog stays in the fair queue, where the next job is chosen."""
    return settings.max_num_seqs + swap_room(settings.max_num_seqs) + LOOKAHEAD


EXIT_REPLICA_LOST = 3  # a process of the engine's replica died: restart the worker (its jobs were requeued)


def run_worker(settings: Settings, model: str | None = None, hostname: str | None = None,
               loglevel: str = "INFO") -> None:
    url = broker_url(settings)
    r = redis_client(url, settings=settings)
    names = Names.from_settings(settings)
    hostname = hostname or worker_hostname("gpu")
    service = EngineService(lambda: LLM(settings, model), r, names, hostname, settings.result_ttl_s,
                            on_replica_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),  # warm shutdown
                            worker_ttl_s=settings.worker_ttl_s, thread_budget=thread_budget(settings),
                            publish_cache=True, step_hold_s=settings.step_hold_ms / 1000)
    engine = service.start()  # built on the thread that will step it (see service.py)
    service.metrics = engine_metrics(settings, engine.model_name, hostname)  # off unless PAGEDQ_METRICS_PORT
    register_served_names(r, names, engine.model_name, served_names(settings)[1:], str(engine.model_path))
    register_model(r, names, model_info(engine, names))
    app = make_celery(settings, url)
    store = JobStore.from_settings(r, names, settings)
    placement = Placement(PlacementPolicy(block_size=engine.engine.config.block_size,
                                          steal_s=settings.placement_steal_s))
    dispatch = Dispatch(FairDispatch(r, names), Seats(service), Peers(r, names, engine.model_name, hostname),
                        placement)
    register_generate(app, dispatch.fair)
    register_dispatch(app, service, store, names, dispatch)
    ControlListener(r, names, control.configured_secret(settings), service, hostname).start()
    ProgressReporter(app, service, r, names, hostname, settings.progress_interval_s, dispatch.bound).start()
    signals.worker_shutting_down.connect(lambda **_: service.drain(settings.drain_timeout_s), weak=False)
    queue = names.generate_queue(engine.model_name)
    log.info("serving %s on queue %s as %s (%d thread(s), GOMP_SPINCOUNT %s)", engine.model_name, queue, hostname,
             torch.get_num_threads(), os.environ.get("GOMP_SPINCOUNT", "unset"))
    code: int | str | None = 0
    try:
        run_celery_worker(app, r, names.worker(hostname), {"role": "gpu", "model": engine.model_name},
                          queues=[queue, names.worker_queue(engine.model_name, hostname)],
                          concurrency=inflight(settings), hostname=hostname,
                          loglevel=loglevel, ttl_s=settings.worker_ttl_s,
                          keep_alive=[names.kv_blocks(engine.model_name, hostname)])
    except SystemExit as e:
        code = e.code
    finally:
        engine.shutdown()  # a pipelined engine stops its stage processes
    sys.exit(EXIT_REPLICA_LOST if service.replica_lost else code)
