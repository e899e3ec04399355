"""Every Redis key, channel and queue name pagedq uses, and the job states.

Keys carry ``settings.key_prefix`` ("pagedq:"), queues ``settings.queue_prefix``
("pagedq."), so two deployments can share one Redis.  Celery/kombu's own keys
(queue lists, unacked messages, event and control channels) get the key
prefix too, through kombu's ``global_keyprefix`` (see ``celery_app``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from pagedq.config.settings import Settings

# Task names: producers send by name, so no process imports another's code.
PREPROCESS_TASK = "pagedq.preprocess"
GENERATE_TASK = "pagedq.generate"
POSTPROCESS_TASK = "pagedq.postprocess"
# A generate *token*, "a job of model M", bound to the next job of its model's fair queue when it runs.
DISPATCH_TASK = "pagedq.dispatch"

PRIORITY_STEPS = list(range(10))
KOMBU_PRIORITY_SEP = "\x06\x16"  # kombu's default separator between a queue name and its priority


class JobState(str, Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED})


def broker_priority(priority: int) -> int:
    """pagedq priority (0-9, 9 most urgent) -> kombu's Redis priority (0 is served first)."""
    return 9 - priority


def model_slug(model: str) -> str:
    """A queue-name-safe form of a model name: 'HuggingFaceTB/SmolLM2-135M' -> 'huggingfacetb-smollm2-135m'."""
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "model"


@dataclass(frozen=True)
class Names:
    key_prefix: str = "pagedq:"
    queue_prefix: str = "pagedq."

    @classmethod
    def from_settings(cls, settings: Settings) -> Names:
        return cls(settings.key_prefix, settings.queue_prefix)

    # --- queues -------------------------------------------------------------
    @property
    def preprocess_queue(self) -> str:
        return f"{self.queue_prefix}preprocess"

    @property
    def results_queue(self) -> str:
        return f"{self.queue_prefix}results"

    def generate_queue(self, model: str) -> str:
        return f"{self.queue_prefix}generate.{model_slug(model)}"

    @property
    def default_queue(self) -> str:
        return f"{self.queue_prefix}default"

    @property
    def event_exchange(self) -> str:
        return f"{self.queue_prefix}events"

    @property
    def control_exchange(self) -> str:
        return f"{self.queue_prefix}control"

    def broker_list(self, queue: str, kombu_priority: int = 0) -> str:
        """The Redis list kombu keeps a queue's messages of one priority in."""
        suffix = f"{KOMBU_PRIORITY_SEP}{kombu_priority}" if kombu_priority else ""
        return f"{self.key_prefix}{queue}{suffix}"

    def broker_lists(self, queue: str) -> list[str]:
        return [self.broker_list(queue, p) for p in PRIORITY_STEPS]

    # --- jobs ---------------------------------------------------------------
    def job(self, job_id: str) -> str:
        """Hash: state, priority, timestamps, attempts, error, ..."""
        return f"{self.key_prefix}job:{job_id}"

    def job_message(self, job_id: str) -> str:
        """String: the job's preprocess message, kept until the job ends so a lost message can be sent again."""
        return f"{self.key_prefix}job-message:{job_id}"

    @property
    def job_flags_epoch(self) -> str:
        """Counter: moved each time a running job's record gains a flag its GPU worker must act on (``cancelling``,
        ``stream``), after the flag is written; a GPU worker re-reads its jobs' records only when it moved (the
        re-check behind a lost control message, ``ProgressReporter.recheck_cancels``)."""
        return f"{self.key_prefix}job-flags-epoch"

    @property
    def active_jobs(self) -> str:
        """Sorted set: every accepted job not yet ended, scored by the time from which it must have a message
        somewhere (its send confirmed; or its creation + ``send_grace_s`` while its send is pending), see
        ``store.lost_jobs``."""
        return f"{self.key_prefix}active-jobs"

    @property
    def job_queues(self) -> str:
        """Set: the generate queues jobs were created for (one per model); with the preprocess and results
        queues, the queues the lost-job sweep reads (it never SCANs the keyspace)."""
        return f"{self.key_prefix}job-queues"

    @property
    def lost_suspects(self) -> str:
        """Set: jobs the last sweep found no message for (sent again if the next sweep agrees)."""
        return f"{self.key_prefix}lost-suspects"

    @property
    def sweep_lock(self) -> str:
        """String with a TTL: the token of the process sweeping for lost messages now (renewed while it sweeps,
        then kept for the rest of the interval, so one sweep runs per interval)."""
        return f"{self.key_prefix}lost-sweep-lock"

    @property
    def unacked(self) -> str:
        """kombu's hash of messages taken by a consumer and not yet acknowledged (tag -> message)."""
        return f"{self.key_prefix}unacked"

    @property
    def lease_clock(self) -> str:
        """Hash: Redis time of the last lease call by any consumer ('seen') and of the last return of the
        broker after a gap ('resumed'); leases are judged only from then on (``store.transport``)."""
        return f"{self.key_prefix}lease-clock"

    @property
    def broker_list_pattern(self) -> str:
        """Matches every queue list of this deployment (all queues, all priorities)."""
        return f"{self.key_prefix}{self.queue_prefix}*"

    def result(self, job_id: str) -> str:
        """String: the completion object (JSON), with a TTL."""
        return f"{self.key_prefix}result:{job_id}"

    def stream(self, job_id: str) -> str:
        """Redis stream of a job's text deltas, ended by an 'end' entry: at most about ``stream_maxlen`` entries
        (XADD MAXLEN ~), and gone ``stream_ttl_after_end_s`` after the job ends (its result holds the text)."""
        return f"{self.key_prefix}stream:{job_id}"

    stream_maxlen: ClassVar[int] = 10_000  # entries: one per engine step at most, so a run's whole text fits
    stream_ttl_after_end_s: ClassVar[int] = 60  # readers following the job read its last entries within a second

    def done_channel(self, job_id: str) -> str:
        """Pub/sub channel that hears the job's terminal state once."""
        return f"{self.key_prefix}done:{job_id}"

    def follow_wake(self, process: str) -> str:
        """Stream (one entry, short TTL): wakes one gateway process's shared XREAD when it follows a new job."""
        return f"{self.key_prefix}gw:follow-wake:{process}"

    def response(self, response_id: str) -> str:
        """Hash with a TTL: a stored response of the Responses API (tenant, job id, request, input items, the
        history its chain holds), ``pipeline/gateway/responses_store.py``; its output is read from the job."""
        return f"{self.key_prefix}gw:response:{response_id}"

    @property
    def responses_ledger(self) -> str:
        """Hash: response id -> "<bytes> <tenant>" of every stored response (counted in the tenant's
        ``max_stored_bytes`` beside its files)."""
        return f"{self.key_prefix}gw:responses:ledger"

    @property
    def responses_expiry(self) -> str:
        """Sorted set: response id -> when its ledger entry lapses (its hash's expiry)."""
        return f"{self.key_prefix}gw:responses:expiry"

    @property
    def results_ledger(self) -> str:
        """Hash: "<when> <tenant>" -> "<bytes> <tenant>": the completion results a gateway answered, summed per
        tenant and the few seconds in which they expire (counted in the tenant's ``max_stored_bytes`` until
        then), ``pipeline/gateway/ledger.py``."""
        return f"{self.key_prefix}gw:results:ledger"

    @property
    def results_expiry(self) -> str:
        """Sorted set: results-ledger entry -> when it lapses (its results' expiry)."""
        return f"{self.key_prefix}gw:results:expiry"

    def batch(self, batch_id: str) -> str:
        """Hash: counts and timestamps of a batch."""
        return f"{self.key_prefix}batch:{batch_id}"

    def batch_done_channel(self, batch_id: str) -> str:
        """Pub/sub channel that hears once when every job of the batch is final."""
        return f"{self.key_prefix}batch-done:{batch_id}"

    def batch_jobs(self, batch_id: str) -> str:
        """List: the batch's job ids in input order."""
        return f"{self.key_prefix}batch:{batch_id}:jobs"

    @property
    def batches_to_finalize(self) -> str:
        """Sorted set: batch id -> when its last job ended.  ``finish`` adds a batch as its last job ends (its
        jobs' records and results then stay, without TTL); a finalizer writes its output, gives those keys
        their TTL and removes it (``pipeline/gateway/batches.py``)."""
        return f"{self.key_prefix}batches-to-finalize"

    # --- result cache (see result_cache.py) ----------------------------------
    def result_cache_version(self, model: str) -> str:
        """Counter: bumping it makes every earlier cache entry of the model unreachable."""
        return f"{self.key_prefix}rcache:version:{model_slug(model)}"

    def result_cache_entry(self, model: str, version: int, digest: str) -> str:
        """String: a cached completion object, with a TTL."""
        return f"{self.key_prefix}rcache:{model_slug(model)}:v{version}:{digest}"

    @property
    def result_cache_index(self) -> str:
        """Sorted set: entry key -> insert time (oldest evicted first)."""
        return f"{self.key_prefix}rcache:index"

    @property
    def result_cache_sizes(self) -> str:
        """Hash: entry key -> bytes."""
        return f"{self.key_prefix}rcache:sizes"

    @property
    def result_cache_bytes(self) -> str:
        """Counter: bytes of all entries."""
        return f"{self.key_prefix}rcache:bytes"

    def backlog(self, model: str) -> str:
        """Counter: jobs of the model accepted and not yet ended (bounded by ``max_queued_jobs``)."""
        return f"{self.key_prefix}backlog:{model_slug(model)}"

    def tenant_backlog(self, model: str, tenant: str) -> str:
        """Counter: the tenant's jobs of the model accepted and not yet ended (bounded by
        ``ceil(tenant_backlog_share x max_queued_jobs)``)."""
        return f"{self.key_prefix}backlog:{model_slug(model)}:tenant:{tenant}"

    @property
    def tenant_weights(self) -> str:
        """Hash: tenant -> weight (a float as a string; missing = 1.0), written by whoever submits for it."""
        return f"{self.key_prefix}tenant_weights"

    # --- fair dispatch (store/dispatch.py) -------------------------------------
    def fair_prefix(self, model: str) -> str:
        """Prefix of a model's fair-queue keys (``fair_tenants``, ``fair_band``, ``fair_waiting``, ``fair_seq``):
        the claim script builds the band keys it visits from it, so the two spellings must agree."""
        return f"{self.key_prefix}fair:{model_slug(model)}:"

    def fair_tenants(self, model: str, priority: int) -> str:
        """Set: the tenants with a job of the model waiting in this priority band."""
        return f"{self.fair_prefix(model)}tenants:{priority}"

    def fair_band(self, model: str, priority: int, tenant: str) -> str:
        """Sorted set: one tenant's waiting jobs of the model in one band; member ``arrival|seq|job id``
        (fixed width, so equal scores sort by arrival then push order), score the start deadline (+inf: none)."""
        return f"{self.fair_prefix(model)}band:{priority}:{tenant}"

    def fair_waiting(self, model: str) -> str:
        """Hash: tenant -> jobs of the model waiting in its fair queue, any band (a tenant with none is absent:
        the *active* tenants)."""
        return f"{self.fair_prefix(model)}waiting"

    def fair_seq(self, model: str) -> str:
        """Counter: push order of the model's fair queue (the last tie-breaker)."""
        return f"{self.fair_prefix(model)}seq"

    def vtc(self, model: str) -> str:
        """Hash: tenant -> virtual token counter for the model (weighted service: (prompt + max_tokens) / weight
        charged at claim, unused output refunded at the end; a float as '%.17g')."""
        return f"{self.key_prefix}vtc:{model_slug(model)}"

    @property
    def fair_index(self) -> str:
        """Hash: job id -> JSON (all strings) of where the job sits in a fair queue (prefix, band, tenant,
        member, deadline, cost) and, once claimed, its slot and charge.  Present from push until unbind/remove:
        a job in it is waiting or bound, never both."""
        return f"{self.key_prefix}fair-index"

    def fair_message(self, job_id: str) -> str:
        """String: the GenerateJob JSON of a job in the fair queue (waiting or bound), gone when it leaves."""
        return f"{self.key_prefix}fair-message:{job_id}"

    def slot(self, slot: str) -> str:
        """String: the job id a worker's slot is bound to (set by claim, cleared by release/unbind)."""
        return f"{self.key_prefix}slot:{slot}"

    @property
    def deadlines(self) -> str:
        """Sorted set: job id -> ``expires_at`` (start deadline, Redis clock) of every job created with one,
        until it ends; ``DeadlineWatch`` expires those past due that never started."""
        return f"{self.key_prefix}deadlines"

    @property
    def deadline_lock(self) -> str:
        """String with a TTL: the token of the process watching deadlines now (one ticks at a time)."""
        return f"{self.key_prefix}deadline-lock"

    # --- workers and models ---------------------------------------------------
    def model(self, model: str) -> str:
        """Hash: a served model's name, fingerprint, max_model_len, vocab_size."""
        return f"{self.key_prefix}model:{model_slug(model)}"

    @property
    def model_pattern(self) -> str:
        return f"{self.key_prefix}model:*"

    @property
    def models_index(self) -> str:
        """Set: the names of the models GPU workers have registered (``names.model``), kept at registration, so
        request paths list models without scanning the keyspace."""
        return f"{self.key_prefix}models"

    def model_folders(self, model: str) -> str:
        """Hash: host name -> the folder a GPU worker on that host serves the model from (a CPU worker there
        reads the tokenizer from it, ``store/model_names.py``); each host may keep its folder elsewhere."""
        return f"{self.key_prefix}model-folders:{model_slug(model)}"

    @property
    def workers_index(self) -> str:
        """Sorted set: hostname -> when its record (``names.worker``) expires (Redis clock), kept by every
        heartbeat (members past it are dropped there), so request paths find live workers without a scan."""
        return f"{self.key_prefix}workers"

    def worker(self, hostname: str) -> str:
        """Hash with a short TTL: a live worker's role, pid, readiness and engine stats."""
        return f"{self.key_prefix}worker:{hostname}"

    def kv_blocks(self, model: str, hostname: str) -> str:
        """Set with the worker's TTL: the hex names (``workers/engine/block_hash``) of the blocks in a GPU worker's
        prefix cache, kept in step by the worker each engine step (for placement)."""
        return f"{self.key_prefix}kv:{model_slug(model)}:{hostname}"

    def kv_blocks_staging(self, model: str, hostname: str) -> str:
        """Set, for an instant: ``kv_blocks`` being rewritten whole, renamed over it in the same pipeline."""
        return f"{self.key_prefix}kv-staging:{model_slug(model)}:{hostname}"

    def placement_workers(self, model: str) -> str:
        """Set: hostnames of the GPU workers that said they serve the model, for placement (a claim
        drops one whose record is gone; liveness is the record's ``beat_at``)."""
        return f"{self.key_prefix}placement:{model_slug(model)}:workers"

    @property
    def fenced(self) -> str:
        """Hash: writes refused because the worker making them had lost the job to another (fencing, ``store.jobs``),
        counted by operation (finish, requeue)."""
        return f"{self.key_prefix}fenced"

    def placement_stats(self, model: str) -> str:
        """Hash: counts of the model's placement decisions (by_cache, by_load, stolen, skipped, nudged)."""
        return f"{self.key_prefix}placement:{model_slug(model)}:stats"

    def placement_session(self, model: str, session: str) -> str:
        """String with a TTL: the GPU worker a session's last job of the model was placed on (affinity)."""
        return f"{self.key_prefix}placement:{model_slug(model)}:session:{session}"

    def worker_queue(self, model: str, hostname: str) -> str:
        """Queue of one GPU worker alone (beside its model's queue): dispatch tokens sent to it by placement's
        nudges.  A nudge is always a spare token (the job it is for keeps its own), so one left on a dead
        worker's queue loses nothing."""
        return f"{self.generate_queue(model)}.w.{hostname}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.key_prefix}worker:*"

    @property
    def control_channel(self) -> str:
        """Pub/sub channel GPU workers listen on for cancel / stream requests."""
        return f"{self.key_prefix}control"

    @property
    def control_key(self) -> str:
        """String, no TTL: the deployment's control key when ``PAGEDQ_CONTROL_SECRET`` is unset (see
        ``store/control.py``): made once by the first process that needs it, read by every other one."""
        return f"{self.key_prefix}control:key"

    def control_seen(self, nonce: str) -> str:
        """Set with a TTL: the workers that acted on the control message with this nonce (a replay is ignored)."""
        return f"{self.key_prefix}control:seen:{nonce}"

    def control_first_seen(self, nonce: str) -> str:
        """String with a TTL: when (Redis clock, seconds) any worker first received the control message with this
        nonce; a copy received later than ``store.control.DELIVERY_WINDOW_S`` after that is a replay, for every
        worker, one started since included."""
        return f"{self.key_prefix}control:first:{nonce}"
