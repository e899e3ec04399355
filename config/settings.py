"""All of pagedq's settings in one pydantic-settings model.

Values come from (highest first): keyword arguments, ``PAGEDQ_*`` environment
variables, the TOML file named by ``PAGEDQ_CONFIG_FILE`` (or ``--config``; never
one found in the working directory by chance), defaults.  A ``PAGEDQ_*``
variable that names no setting is an error naming the closest one: a typo
never goes unnoticed.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from pagedq.config.scheduling import DEFAULT_TENANT
from pagedq.config.sentinel import parse_sentinel_url
from pagedq.config.served import parse_served_names

log = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(value: int | str) -> int:
    """'2GiB' -> 2147483648; plain integers pass through."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MiB, 2GiB or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _default_state_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedq"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDQ_", extra="ignore")

    # --- where things live -------------------------------------------------
    state_dir: Path = Field(default_factory=_default_state_dir,
                            description="embedded Redis data, converted models, logs")
    broker_url: str | None = Field(None, description="Redis URL; unset = start an embedded redis-server")
    control_secret: SecretStr | None = Field(
        None, description="signs cancel/stream/reload messages to workers; unset = one random key per deployment, "
                          "made once and kept in Redis (<key_prefix>control:key)")
    redis_master_name: str = Field("pagedq", min_length=1, description="with a sentinel:// broker URL: the name "
                                   "the sentinels monitor the master under")
    redis_sentinel_password: SecretStr | None = Field(None, description="with a sentinel:// broker URL: the "
                                                      "sentinels' own password (requirepass); unset = the URL's")
    redis_min_replicas_ack: int = Field(0, ge=0, description="replicas that must confirm (WAIT) a job's record "
                                        "and message before submit returns, and its end before it is announced; "
                                        "0 = no wait (a failover may lose the master's last writes)")
    redis_replica_ack_timeout_s: float = Field(5.0, gt=0, description="with redis_min_replicas_ack: how long to "
                                               "wait for the replicas before raising NotReplicated")
    redis_ca_file: Path | None = Field(None, description="CA bundle that signs the Redis server's certificate "
                                       "(rediss:// URLs; default: the system's CAs). Certificates are always verified")
    redis_cert_file: Path | None = Field(None, description="client certificate for rediss:// (mutual TLS)")
    redis_key_file: Path | None = Field(None, description="its private key")
    key_prefix: str = "pagedq:"
    queue_prefix: str = "pagedq."

    # --- model -------------------------------------------------------------
    model: str = DEFAULT_MODEL
    served_model_name: Annotated[list[str] | None, NoDecode] = Field(
        None, description="the names requests call the model by (vLLM's --served-model-name), e.g. "
                          "smollm2,default-chat: the first is its name everywhere (queue, registry, result cache, "
                          "answers), the others aliases; unset = PAGEDQ_MODEL is the name")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "auto"
    max_model_len: int | None = None

    # --- engine ------------------------------------------------------------
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory: int = Field(2 << 30, description="bytes of KV cache (accepts '2GiB')")
    num_kv_blocks: int | None = Field(None, ge=2, description="overrides kv_cache_memory")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=16)
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default = all cores")
    adaptive_threads: bool = Field(True, description="a GPU worker running its engine on the CPU computes with the "
                                                     "cores other processes leave free (re-planned every 0.5 s)")
    omp_spin_count: int = Field(
        50_000, ge=0, description="GOMP_SPINCOUNT of a GPU worker's OpenMP threads (and its stages'): how long an "
        "idle one spins before it sleeps; libgomp's own default (300,000) burns milliseconds of a shared core each "
        "time another process takes one mid-operator; a GOMP_SPINCOUNT or "
        "OMP_WAIT_POLICY in the environment wins")

    # --- parallelism (one replica over several processes) --------------------
    pipeline_stages: int = Field(1, ge=1, description="processes, each holding a contiguous range of layers")
    tensor_parallel: int = Field(1, ge=1, description="processes per stage, each holding a slice of every layer")
    pipeline_layer_split: list[int] | None = Field(
        None, description="layers per stage, e.g. [17, 13]; default balances lm_head's cost on the last stage")
    stage_master: str | None = Field(
        None, description="HOST:PORT of the replica's rendezvous; set = stages are started separately "
                          "(pagedq stage), unset = the driver spawns them on a free local port")
    stage_timeout_s: float = Field(600, gt=0, description="a replica process silent this long is taken as dead")
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend between a replica's processes; auto = NCCL on CUDA, else gloo")

    # --- pipeline ----------------------------------------------------------
    result_ttl_s: int = Field(24 * 3600, ge=1)
    default_priority: int = Field(5, ge=0, le=9)
    step_hold_ms: float = Field(50, ge=0, description="a GPU worker about to run a step with nothing to decode "
                                "and less than a step's budget of prompt tokens waits while jobs keep arriving "
                                "(one at most this many ms after the last), up to half its last such step's "
                                "time (or twice this): fuller steps for many short jobs; a lone job (the first "
                                "in this long, after a step of one job, with no more of its model's jobs on "
                                "their way) never waits; 0 = step at once")
    result_cache: bool = True
    result_cache_ttl_s: int = Field(3600, ge=1)
    result_cache_max_bytes: int = Field(64 << 20, ge=0)

    # --- queue ---------------------------------------------------------------
    redis_dir: Path | None = Field(None, description="embedded redis-server's data (AOF); default state_dir/redis")
    redis_appendfsync: Literal["everysec", "always", "no"] = Field(
        "everysec", description="embedded Redis: fsync of the append-only file (everysec: lose at most ~1 s "
                                "of writes to a crash; always: none, slower)")
    redis_maxmemory: int = Field(4 << 30, ge=0, description="embedded Redis memory bound (accepts '4GiB'; 0 = "
                                 "none); writes beyond it are refused, never evicted")
    file_store_share: float = Field(
        0.5, gt=0, le=1, description="the gateway's files (uploads and batch output) take at most this share "
                                     "of Redis's maxmemory; beyond it new files are refused (429), never jobs")
    visibility_timeout_s: int = Field(
        3600, ge=1, description="upper bound on a message's lease (see worker_ttl_s): redelivered after this "
                                "long without its worker renewing it")
    drain_timeout_s: float = Field(30, ge=0, description="on SIGTERM a GPU worker takes no new jobs and lets "
                                   "running ones finish for this long, then puts the rest back on the queue")
    max_queued_jobs: int = Field(100_000, ge=1, description="jobs of one model accepted and not yet ended; "
                                 "beyond it submit raises RequestError(code='queue_full') and writes nothing")
    tenant: str = Field(DEFAULT_TENANT, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                        description="the tenant a Python producer's jobs are charged to (Client(tenant=...))")
    tenant_weights: dict[str, float] = Field(
        default_factory=dict, description='JSON map tenant -> weight (> 0, default 1), e.g. {"team-a": 2}: a '
                                          "tenant's share of service within a priority band is its weight's share")
    tenant_backlog_share: float = Field(
        1.0, gt=0, le=1, description="one tenant's jobs of a model accepted and not yet ended are at most "
                                     "ceil(this x max_queued_jobs); beyond it its submits get queue_full. 1.0 (the "
                                     "default) keeps the whole bound for any tenant; a shared deployment sets e.g. 0.5")
    placement_steal_s: float = Field(0.5, gt=0, description="cache-aware placement: a job another worker holds "
                                     "more of is taken by any worker with a free seat once it has waited this long "
                                     "(fleet/placement.py)")
    batch_priority: int | None = Field(None, ge=0, le=9, description="priority of batch jobs (Batches API, "
                                       "submit_batch, run-batch) whose line sets none; unset = default_priority")
    max_attempts: int = Field(3, ge=1, description="starts of a job whose worker dies each time before it "
                                                  "fails with code 'poison'")
    send_grace_s: float = Field(30, gt=0, description="the lost-job sweep looks for a job's message only once its "
                                "producer confirmed sending it, or this long after the job was written (a "
                                "producer killed between the two: its jobs are sent again about this much later)")
    worker_ttl_s: int = Field(
        15, ge=2, description="a worker's heartbeat record and its messages' leases last this long unless "
                              "renewed: a dead worker's jobs go back on their queues within about 1.3x this")
    clock_offset_s: float = Field(0, description="tests only: this process's wall clock (time.time) runs this many "
                                  "seconds ahead, as on a host whose clock is off; leases never depend on it")
    cpu_worker_concurrency: int = Field(1, ge=1, description="threads of a CPU (preprocess/postprocess) worker")
    cpu_worker_nice: int = Field(10, ge=0, le=19, description="a CPU worker lowers its scheduling priority by this "
                                 "much (nice), so on a host it shares with an engine computing on the CPU, a "
                                 "burst of preprocessing (a batch of thousands of lines) does not slow every "
                                 "engine step (one leading its own session lowers its Linux autogroup too); 0 keeps the "
                                 "priority it was started with")
    progress_interval_s: float = Field(2.0, gt=0, description="how often a GPU worker reports tokens so far")
    model_wait_s: float = Field(600, ge=0, description="how long preprocess waits for a worker to serve a model")
    broker_timeout_s: float = Field(10, gt=0, description="a producer call to Redis answers or raises "
                                                         "BrokerUnavailable within about this long")
    wait_timeout_s: float = Field(3600, gt=0, description="default of Client.result()/wait(): seconds before "
                                                         "TimeoutError (the job goes on; wait again)")
    gateway_limit_concurrency: int = Field(
        2048, ge=1, description="completion requests (blocking or streamed) one gateway process serves at once; "
                                "beyond it 503 with Retry-After, before any job is created (pagedq serve "
                                "--limit-concurrency)")

    # --- metrics (docs/metrics.md) -------------------------------------------
    metrics_port: int = Field(0, ge=0, le=65535, description="workers serve Prometheus metrics on the first "
                              "free port from this one up (each worker its own, in its record); 0 = off")
    metrics_address: str = Field("127.0.0.1", description="address the workers' metrics endpoints listen on")

    @field_validator("kv_cache_memory", "result_cache_max_bytes", "redis_maxmemory", mode="before")
    @classmethod
    def _sizes(cls, value: int | str) -> int:
        return parse_bytes(value)

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _served_names(cls, value: object) -> list[str] | None:
        return parse_served_names(value)

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, value: str | None) -> str | None:
        if value:
            parse_sentinel_url(value)  # a sentinel:// URL is checked whole here, once (raises naming the fault)
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {t: w for t, w in value.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be > 0: {bad}")
        return value

    @property
    def redis_data_dir(self) -> Path:
        return self.redis_dir or self.state_dir / "redis"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        check_environment()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if os.environ.get("PAGEDQ_CONFIG_FILE"):
            toml_file = Path(os.environ["PAGEDQ_CONFIG_FILE"])
            if not toml_file.is_file():
                raise FileNotFoundError(f"PAGEDQ_CONFIG_FILE: no such file: {toml_file}")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


# Settings that are gone, each with what replaced it: still accepted in the environment, with one warning line.
DEPRECATED_VARIABLES = {
    "PAGEDQ_FAIR_SHARE": "fair dispatch is the only dispatch path now (docs/queue.md#which-job-next)",
    "PAGEDQ_PLACEMENT": "cache-aware placement is always on now; PAGEDQ_PLACEMENT_STEAL_S still tunes it",
    "PAGEDQ_WORKER_MAX_INFLIGHT": "a GPU worker holds max_num_seqs x 1.5 + 4 dispatch tokens (PAGEDQ_MAX_NUM_SEQS)",
}
_warned: set[str] = set()

# PAGEDQ_* variables read by something other than Settings.
OTHER_VARIABLES = {"PAGEDQ_CONFIG_FILE", "PAGEDQ_TEST_SEED", "PAGEDQ_API_KEYS_FILE", "PAGEDQ_KERNEL_TEST_DEVICE",
                   "PAGEDQ_REDIS_PASSWORD"}  # the last: docker compose's, in the shell that runs it


def check_environment() -> None:
    """Raise ValueError for a PAGEDQ_* variable that names no setting, naming the closest one; a deprecated one
    is accepted with one warning line per process."""
    known = {f"PAGEDQ_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    for var in sorted(v for v in os.environ if v.upper().startswith("PAGEDQ_")):
        if var.upper() in DEPRECATED_VARIABLES:
            if var.upper() not in _warned:
                _warned.add(var.upper())
                log.warning("%s is deprecated and has no effect: %s", var, DEPRECATED_VARIABLES[var.upper()])
        elif var.upper() not in known:
            close = difflib.get_close_matches(var.upper(), sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; see docs/configuration.md"
            raise ValueError(f"unknown setting {var}{hint}")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
