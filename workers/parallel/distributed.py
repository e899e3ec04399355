"""A model replica spread over processes: pipeline stages x tensor-parallel shards.

Global rank ``r`` is shard ``r % T`` of stage ``r // T`` (``S`` stages, ``T``
shards each, ``S * T`` processes).  Rank 0 is the driver: it runs the engine
and the scheduler, and is shard 0 of stage 0.  Processes rendezvous over TCP
through a ``TCPStore`` that rank 0 hosts at ``HOST:PORT``, so stages may live
on different hosts; gloo on CPU, NCCL on CUDA.

The process groups are built from that store directly rather than through
``init_process_group``: the global default group is one per process, and an
engine is a library object (a test or a benchmark may drive two replicas,
one after the other or at once).

Between processes everything travels as tensors through ``torch.distributed``
point-to-point calls; structured data (sampling parameters, sampled tokens,
logprobs) travels as JSON bytes inside a uint8 tensor, never pickle.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from pagedq.workers.engine.executor import ReplicaLostError
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.layers import Shard

__all__ = ["ReplicaLostError"]  # re-exported: the core defines it, the replica raises it

log = logging.getLogger(__name__)


# --- layout -------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelConfig:
    pipeline_stages: int = 1
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_stages < 1 or self.tensor_parallel < 1:
            raise ValueError("pipeline_stages and tensor_parallel must be >= 1")

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.tensor_parallel

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel

    def shard_of(self, rank: int) -> int:
        return rank % self.tensor_parallel

    def rank_of(self, stage: int, shard: int) -> int:
        return stage * self.tensor_parallel + shard

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: shard 0 of the last stage."""
        return self.rank_of(self.pipeline_stages - 1, 0)


def layer_ranges(cfg: ModelConfig, stages: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage.

    Without an explicit ``split`` the last stage gets fewer layers: it also
    runs the final norm and lm_head, which for a small model with a large
    vocabulary costs several layers' worth of work per sampled token.
    """
    if split is None:
        split = balanced_split(cfg, stages)
    if len(split) != stages or sum(split) != cfg.num_layers or min(split) < 1:
        raise ValueError(f"layer split {split} must be {stages} positive counts summing to {cfg.num_layers}")
    ranges, start = [], 0
    for n in split:
        ranges.append((start, start + n))
        start += n
    return ranges


def balanced_split(cfg: ModelConfig, stages: int, sampled_fraction: float = 0.5) -> list[int]:
    """Layer counts equalising per-stage work, charging the last stage for lm_head.

    ``sampled_fraction`` is the share of tokens whose logits are computed
    (every decode token, one per prompt): about half in a chat workload.
    """
    if stages > cfg.num_layers:
        raise ValueError(f"{stages} stages for a model of {cfg.num_layers} layers")
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_cost = h * (2 * q + 2 * kv) + 3 * h * cfg.intermediate_size
    head_layers = sampled_fraction * cfg.vocab_size * h / layer_cost
    target = (cfg.num_layers + head_layers) / stages
    counts = [max(1, round(target))] * (stages - 1)
    counts.append(cfg.num_layers - sum(counts))
    while counts[-1] < 1:  # the head outweighs what the last stage can give up
        i = counts.index(max(counts[:-1]))
        counts[i] -= 1
        counts[-1] += 1
    return counts


# --- rendezvous ---------------------------------------------------------------
@dataclass
class ReplicaSpec:
    """What the driver tells every process at start, so a stage needs only --rank/--stages/--master."""

    model: str
    model_config: dict
    pipeline_stages: int
    tensor_parallel: int
    layer_ranges: list[tuple[int, int]]
    num_blocks: int
    block_size: int
    dtype: str
    attention_backend: str

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.pipeline_stages, self.tensor_parallel)


@dataclass
class Replica:
    """This process's place in an initialised replica."""

    rank: int
    parallel: ParallelConfig
    device: torch.device
    comm_device: torch.device  # where tensors handed to torch.distributed live
    spec: ReplicaSpec
    world: object  # the replica's process group (every rank)
    shard_group: object | None = None  # this stage's shards (tensor parallelism), ranked by shard
    store: object | None = None  # the rendezvous store; rank 0 hosts it, so it must live as long

    def close(self, failed: bool = False) -> None:
        """Release the process groups: a clean shutdown, or an abort when a peer is gone (``failed``)."""
        for group in (self.shard_group, self.world):
            if group is None:
                continue
            try:
                if failed:
                    group.abort()
                else:
                    group.shutdown()
            except RuntimeError as e:
                log.debug("closing a process group: %s", e)
        self.world = self.shard_group = self.store = None

    @property
    def stage(self) -> int:
        return self.parallel.stage_of(self.rank)

    @property
    def shard_rank(self) -> int:
        return self.parallel.shard_of(self.rank)

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.parallel.pipeline_stages - 1

    @property
    def layer_range(self) -> tuple[int, int]:
        return tuple(self.spec.layer_ranges[self.stage])

    def shard(self, cfg: ModelConfig) -> Shard:
        return Shard.of(cfg, self.shard_rank, self.parallel.tensor_parallel, self.shard_group)

    @property
    def upstream(self) -> int:
        """Where this process's micro-batches come from (meaningless for the driver)."""
        if self.stage == 0:
            return 0
        return self.parallel.rank_of(self.stage - 1, self.shard_rank)

    @property
    def downstream(self) -> int | None:
        """Where this process's hidden states go next, or None on the last stage."""
        return None if self.is_last_stage else self.parallel.rank_of(self.stage + 1, self.shard_rank)


def backend_for(device: torch.device, choice: str = "auto") -> str:
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise ValueError("dist_backend=nccl needs a CUDA device")
    return choice


def new_group(store, rank: int, size: int, backend: str, timeout: timedelta):
    """A standalone process group over ``store`` (not registered as torch.distributed's default)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def init_replica(rank: int, world_size: int, master: str, device: torch.device, timeout_s: float,
                 spec: ReplicaSpec | None = None, children: Sequence[subprocess.Popen] = (),
                 backend: str = "auto") -> Replica:
    """Join the replica at ``master`` ("HOST:PORT"); rank 0 passes ``spec``, the others receive it.

    Rank 0 hosts the TCPStore on PORT; the others connect to it (retrying until
    the timeout, so they may start first) and announce themselves.  Rank 0
    waits for all of them, failing early if a process it spawned dies.
    """
    backend = backend_for(device, backend)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    host, port = master.rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    log.info("rank %d/%d: rendezvous at tcp://%s (%s)", rank, world_size, master, backend)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if rank == 0:
        _wait_for_ranks(store, world_size, children, timeout_s)
    else:
        store.set(f"pagedq/joined/{rank}", "1")
    world = new_group(dist.PrefixStore("pagedq/world", store), rank, world_size, backend, timeout)
    comm_device = device if backend == "nccl" else torch.device("cpu")
    spec = _share_spec(world, rank, world_size, spec, comm_device)
    parallel = spec.parallel
    if parallel.world_size != world_size:
        raise ValueError(f"the driver runs {parallel.world_size} processes, this one was told {world_size}")
    shard_group = None
    if parallel.tensor_parallel > 1:
        stage = parallel.stage_of(rank)
        shard_group = new_group(dist.PrefixStore(f"pagedq/stage{stage}", store), parallel.shard_of(rank),
                                parallel.tensor_parallel, backend, timeout)
    return Replica(rank, parallel, device, comm_device, spec, world, shard_group, store)


def _wait_for_ranks(store, world_size: int, children: Sequence[subprocess.Popen], timeout_s: float) -> None:
    keys = [f"pagedq/joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        for child in children:
            if child.poll() is not None:
                raise ReplicaLostError(f"stage process {child.pid} exited ({child.returncode}) before joining")
        if time.monotonic() > deadline:
            raise ReplicaLostError(f"only some of {world_size - 1} stage processes joined in {timeout_s:.0f} s")
        time.sleep(0.05)


def _share_spec(world, rank: int, world_size: int, spec: ReplicaSpec | None,
                comm_device: torch.device) -> ReplicaSpec:
    if rank == 0:
        payload = encode_json(dataclasses.asdict(spec), comm_device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=comm_device)
        for r in range(1, world_size):
            world.send([size], r, 0).wait()
            world.send([payload], r, 0).wait()
        return spec
    size = torch.empty(1, dtype=torch.int64, device=comm_device)
    world.recv([size], 0, 0).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=comm_device)
    world.recv([payload], 0, 0).wait()
    raw = decode_json(payload)
    raw["layer_ranges"] = [tuple(r) for r in raw["layer_ranges"]]
    return ReplicaSpec(**raw)


# --- messages -----------------------------------------------------------------
def encode_json(obj, device: torch.device | str = "cpu") -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def decode_json(t: torch.Tensor):
    return json.loads(t.cpu().numpy().tobytes())


class Kind(IntEnum):
    STOP = 0
    BATCH = 1  # a micro-batch: plan, control, hidden (from stage 1 on)
    RESULT = 2  # sampled tokens, back to the driver
    PING = 3  # keeps idle links inside the timeout
    STATS = 4  # asks every process for its busy intervals


@dataclass
class Message:
    kind: int
    plan: torch.Tensor | None = None  # int64: the packed step inputs (model_runner.pack_step)
    control: torch.Tensor | None = None  # uint8 JSON
    hidden: torch.Tensor | None = None  # [num_tokens, hidden_size]


class Link:
    """Point-to-point messages over torch.distributed.

    Sends are asynchronous: the sender goes on computing while the receiver
    takes the data, and the tensors are held until their sends complete.  A
    message is a fixed int64 header (kind and part sizes), then its non-empty
    parts, each one send.
    """

    def __init__(self, group, comm_device: torch.device, hidden_size: int, dtype: torch.dtype) -> None:
        self.group = group
        self.device = comm_device
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._pending: deque = deque()  # (work, tensors kept alive)

    def send(self, peer: int, msg: Message) -> None:
        parts = [t for t in (msg.plan, msg.control, msg.hidden) if t is not None and t.numel()]
        header = torch.tensor([msg.kind, _numel(msg.plan), _numel(msg.control),
                               0 if msg.hidden is None else msg.hidden.shape[0]], dtype=torch.int64)
        for t in [header.to(self.device), *(p.to(self.device) for p in parts)]:
            t = t.contiguous()
            self._pending.append((self.group.send([t], peer, 0), t))
        self._reap()

    def recv(self, peer: int) -> Message:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        self.group.recv([header], peer, 0).wait()
        kind, n_plan, n_control, n_rows = header.tolist()
        msg = Message(kind)
        if n_plan:
            msg.plan = self._recv(peer, (n_plan,), torch.int64)
        if n_control:
            msg.control = self._recv(peer, (n_control,), torch.uint8)
        if n_rows:
            msg.hidden = self._recv(peer, (n_rows, self.hidden_size), self.dtype)
        return msg

    def _recv(self, peer: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.group.recv([t], peer, 0).wait()
        return t

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()[0].wait()  # raises if the send failed

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft()[0].wait()


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


# --- busy time ----------------------------------------------------------------
@dataclass
class BusyLog:
    """Intervals (monotonic clock, shared by processes on one host) during which a process computed,
    and the CPU time it used (all its threads) since the last ``take``."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    _start: float | None = None
    _cpu_mark: float = field(default_factory=time.process_time)

    def begin(self) -> None:
        if self._start is None:
            self._start = time.monotonic()

    def end(self) -> None:
        if self._start is not None:
            self.spans.append((self._start, time.monotonic()))
            self._start = None

    def take(self) -> dict:
        spans, self.spans = self.spans, []
        cpu, self._cpu_mark = time.process_time() - self._cpu_mark, time.process_time()
        return {"spans": spans, "cpu_s": cpu}


def overlap_report(per_rank: list[list[tuple[float, float]]], start: float, end: float) -> dict:
    """Share of ``[start, end]`` each process was busy, and during which >= 2 were busy at once."""
    events = []
    for spans in per_rank:
        for a, b in spans:
            a, b = max(a, start), min(b, end)
            if b > a:
                events += [(a, 1), (b, -1)]
    events.sort()
    wall = max(end - start, 1e-9)
    overlapped, active, last = 0.0, 0, start
    for t, delta in events:
        if active >= 2:
            overlapped += t - last
        active, last = active + delta, t
    busy = [sum(min(b, end) - max(a, start) for a, b in spans if min(b, end) > max(a, start)) / wall
            for spans in per_rank]
    return {"busy": busy, "overlap": overlapped / wall, "wall_s": wall}
