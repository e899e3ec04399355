"""The engine's executor across a replica of processes (pipeline stages x tensor-parallel shards).

``PipelineExecutor`` is the driver (rank 0) of the replica: it runs stage 0's
layers itself, sends hidden states on, and keeps up to one micro-batch per
stage in flight so the stages compute at the same time.  It implements the
engine core's ``Executor`` protocol, like ``LocalExecutor`` does in one process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import fields

import torch

from pagedq.config import Settings
from pagedq.kernels import get_attention_backend
from pagedq.workers.engine.executor import SamplerOutput, StepResult
from pagedq.workers.engine.scheduler import SchedulerOutput
from pagedq.workers.engine.sequence import Sequence
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.layers import Shard
from pagedq.workers.model.registry import build_model, cache_layout
from pagedq.workers.model.runner import ModelRunner, kv_cache_block_bytes
from pagedq.workers.parallel.distributed import (
    BusyLog,
    Kind,
    Link,
    Message,
    ParallelConfig,
    Replica,
    ReplicaLostError,
    ReplicaSpec,
    decode_json,
    encode_json,
    init_replica,
    layer_ranges,
    overlap_report,
)
from pagedq.workers.processes import free_port, spawn

log = logging.getLogger(__name__)


def plan_kv_blocks(cfg: ModelConfig, settings: Settings, parallel: ParallelConfig,
                   ranges: list[tuple[int, int]], dtype: torch.dtype) -> int:
    """KV blocks every process can hold in ``kv_cache_memory`` (the busiest process decides)."""
    if settings.num_kv_blocks:
        return settings.num_kv_blocks
    layout = cache_layout(cfg)
    layers = max(layout.stage_slots(a, b)[1] for a, b in ranges)  # cache tensors of the busiest stage
    heads = max(Shard.of(cfg, t, parallel.tensor_parallel).num_kv_heads for t in range(parallel.tensor_parallel))
    return settings.kv_cache_memory // kv_cache_block_bytes(cfg, layers, settings.block_size, dtype, heads)


def spawn_stage(rank: int, master: str, model: str, settings: Settings) -> subprocess.Popen:
    """Start rank ``rank`` as a child process that dies with this one (``stage.py``'s ``__main__``)."""
    spec = {"rank": rank, "stages": settings.pipeline_stages, "tensor_parallel": settings.tensor_parallel,
            "master": master, "model": model, "device": settings.device, "threads": settings.num_threads}
    return spawn([sys.executable, "-m", "pagedq.workers.parallel.stage", json.dumps(spec)],
                 env={"PAGEDQ_DIST_BACKEND": settings.dist_backend})


class PipelineExecutor:
    """Rank 0 of a replica: stage 0 (shard 0) plus the micro-batch bookkeeping."""

    PING_INTERVAL_S = 30.0

    def __init__(self, replica: Replica, runner: ModelRunner, children: list[subprocess.Popen]) -> None:
        self.replica = replica
        self.parallel = replica.parallel
        self.runner = runner
        self.children = children
        self.max_inflight = self.parallel.pipeline_stages
        self.link = Link(replica.world, replica.comm_device, runner.model.cfg.hidden_size, runner.dtype)
        self.busy = BusyLog()
        self._inflight: deque[tuple[SchedulerOutput, list[Sequence], SamplerOutput | None]] = deque()
        self._known: set[str] = set()  # request ids the sampling rank has a copy of
        self._dropped: list[str] = []  # left the engine; the sampling rank is told with the next batch
        self._lock = threading.Lock()  # sends from the step thread and the keep-alive thread
        self._last_send = time.monotonic()
        self._failure: BaseException | None = None
        self._closed = threading.Event()
        self._pinger = threading.Thread(target=self._keep_alive, name="replica-ping", daemon=True)
        self._pinger.start()

    # --- construction -------------------------------------------------------
    @classmethod
    def start(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], model: str, settings: Settings,
              device: torch.device, dtype: torch.dtype) -> PipelineExecutor:
        """Spawn (or wait for) the other ranks, rendezvous, and load stage 0's share of the weights."""
        parallel = ParallelConfig(settings.pipeline_stages, settings.tensor_parallel)
        ranges = layer_ranges(cfg, parallel.pipeline_stages, settings.pipeline_layer_split)
        num_blocks = plan_kv_blocks(cfg, settings, parallel, ranges, dtype)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={settings.kv_cache_memory} holds fewer than 2 blocks per process")
        spec = ReplicaSpec(model=model, model_config=cfg.__dict__, pipeline_stages=parallel.pipeline_stages,
                           tensor_parallel=parallel.tensor_parallel, layer_ranges=ranges, num_blocks=num_blocks,
                           block_size=settings.block_size, dtype=settings.dtype,
                           attention_backend=settings.attention_backend)
        master = settings.stage_master or f"127.0.0.1:{free_port()}"
        if not settings.stage_master and device.type == "cpu" and not settings.num_threads:
            # All processes share this host's cores; more threads than cores stalls every all-reduce.
            threads = max(1, len(os.sched_getaffinity(0)) // parallel.world_size)
            settings = settings.model_copy(update={"num_threads": threads})
            torch.set_num_threads(threads)
        children = [] if settings.stage_master else [
            spawn_stage(r, master, model, settings) for r in range(1, parallel.world_size)]
        try:
            replica = init_replica(0, parallel.world_size, master, device, settings.stage_timeout_s, spec,
                                   children=children, backend=settings.dist_backend)
        except BaseException:
            for child in children:
                child.kill()
            raise
        attention = get_attention_backend(settings.attention_backend, device)
        lm = build_model(cfg, weights, replica.layer_range, device=device, dtype=dtype, attention=attention,
                      shard=replica.shard(cfg))
        runner = ModelRunner(lm, num_blocks, settings.block_size, device, dtype)
        log.info("replica up: %d stage(s) x %d shard(s), layers %s, %d KV blocks; driver holds layers %s",
                 parallel.pipeline_stages, parallel.tensor_parallel, ranges, num_blocks, replica.layer_range)
        return cls(replica, runner, children)

    @property
    def num_blocks(self) -> int:
        return self.replica.spec.num_blocks

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # --- steps ----------------------------------------------------------------
    def submit(self, sched: SchedulerOutput) -> None:
        self.check()
        self.busy.begin()
        try:
            self._submit(sched)
        except RuntimeError as e:  # torch.distributed reports a dead or silent peer as RuntimeError
            raise self._lost(e) from e

    def _submit(self, sched: SchedulerOutput) -> None:
        p = self.parallel
        inputs = self.runner.prepare(sched)
        seqs = inputs.sample_seqs
        control = encode_json({**self._control(seqs), "prompt": inputs.prompt_spans},
                              self.replica.comm_device) if p.pipeline_stages > 1 else None
        for shard in range(1, p.tensor_parallel):
            self._send(shard, Message(Kind.BATCH, inputs.packed, control))
        hidden = self.runner.forward(inputs)
        if p.pipeline_stages == 1:
            self._inflight.append((sched, seqs, self.runner.sample(hidden, inputs, seqs)))
            return
        self._send(self.replica.downstream, Message(Kind.BATCH, inputs.packed, control, hidden))
        self._inflight.append((sched, seqs, None))

    def _send(self, peer: int, msg: Message) -> None:
        with self._lock:
            self.link.send(peer, msg)
            self._last_send = time.monotonic()

    def _control(self, seqs: list[Sequence]) -> dict:
        """What the sampling rank needs beyond hidden states: new sequences' prompts and parameters."""
        # The dataclass fields only: __dict__ also holds cached properties (a frozenset is no JSON).
        new = [[s.request_id, s.prompt_token_ids, {f.name: getattr(s.params, f.name) for f in fields(s.params)}]
               for s in seqs if s.request_id not in self._known]
        self._known.update(s.request_id for s in seqs)
        dropped, self._dropped = self._dropped, []
        return {"drop": dropped, "new": new, "sample": [s.request_id for s in seqs]}

    def collect(self) -> StepResult:
        sched, seqs, sampled = self._inflight.popleft()
        if sampled is None:
            self.busy.end()  # waiting for the last stage is not work
            try:
                msg = self.link.recv(self.parallel.sampler_rank)
            except RuntimeError as e:
                raise self._lost(e) from e
            self.busy.begin()
            if msg.kind != Kind.RESULT:
                raise self._lost(RuntimeError(f"expected a result, got message kind {msg.kind}"))
            sampled = decode_sampled(decode_json(msg.control))
            if len(sampled.token_ids) != len(seqs):
                raise self._lost(RuntimeError("the last stage sampled a different batch"))
        return StepResult(sched, seqs, sampled)

    def forget(self, request_id: str) -> None:
        if request_id in self._known:
            self._known.discard(request_id)
            self._dropped.append(request_id)

    # --- health ---------------------------------------------------------------
    def check(self) -> None:
        """Raise ReplicaLostError if a process of the replica has died (or a send to it failed)."""
        if self._failure is not None:
            raise ReplicaLostError(str(self._failure))
        for child in self.children:
            if child.poll() is not None:
                raise self._lost(RuntimeError(f"stage process {child.pid} exited with {child.returncode}"))

    def _lost(self, cause: BaseException) -> ReplicaLostError:
        if self._failure is None:
            self._failure = cause
            log.error("replica lost: %s", cause)
        return ReplicaLostError(str(cause))

    def _keep_alive(self) -> None:
        """Ping idle links so a stage waiting for work does not hit the receive timeout."""
        while not self._closed.wait(1.0):
            if self._failure is not None or time.monotonic() - self._last_send < self.PING_INTERVAL_S:
                continue
            try:
                self._broadcast(Kind.PING)
            except RuntimeError as e:
                self._lost(e)

    def _broadcast(self, kind: int) -> None:
        """Send a bare message down every link the driver feeds (it travels on through the stages)."""
        for shard in range(1, self.parallel.tensor_parallel):
            self._send(shard, Message(kind))
        if self.parallel.pipeline_stages > 1:
            self._send(self.replica.downstream, Message(kind))

    # --- measurements -----------------------------------------------------------
    def busy_report(self, start: float, end: float) -> dict:
        """Per rank: busy share of ``[start, end]`` and CPU seconds since ``reset_busy``; and the share of
        the interval during which >= 2 ranks were busy at once.  Needs an idle replica."""
        if self._inflight:
            raise RuntimeError("busy_report needs an idle replica")
        self.busy.end()
        logs = [self.busy.take()]
        self._broadcast(Kind.STATS)
        for rank in range(1, self.parallel.world_size):
            logs.append(decode_json(self.link.recv(rank).control))
        report = overlap_report([[tuple(s) for s in log["spans"]] for log in logs], start, end)
        report["cpu_s"] = [log["cpu_s"] for log in logs]
        return report

    def reset_busy(self) -> None:
        self.busy.take()
        self._broadcast(Kind.STATS)
        for rank in range(1, self.parallel.world_size):
            self.link.recv(rank)

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._pinger.join()  # a daemon thread still running at interpreter exit can abort the process
        if self._failure is None:
            try:
                while self._inflight:  # the last stage must hand its results over before it can stop
                    self.collect()
                self._broadcast(Kind.STOP)
                self.link.flush()
            except (RuntimeError, ReplicaLostError) as e:
                log.warning("stopping the replica: %s", e)
        failed = self._failure is not None
        if failed:  # closing our ends tells the surviving stages to exit
            self.replica.close(failed=True)
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if not failed:
            self.replica.close()


def encode_sampled(sampled: SamplerOutput) -> dict:
    return {"tokens": sampled.token_ids, "logprobs": sampled.logprobs, "prompt": sampled.prompt_logprobs}


def decode_sampled(raw: dict) -> SamplerOutput:
    logprobs = [None if lp is None else {"token": tuple(lp["token"]), "top": [tuple(t) for t in lp["top"]]}
                for lp in raw["logprobs"]]
    return SamplerOutput(raw["tokens"], logprobs, raw.get("prompt") or [])
