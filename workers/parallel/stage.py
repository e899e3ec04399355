"""``pagedq stage``: one process of a replica that is not its driver.

    pagedq stage --rank 1 --stages 2 --master HOST:PORT [--tensor-parallel T] [--model M]

It joins the replica's TCP rendezvous, learns its layers, shard and KV
cache size from the driver, loads only those weights and then serves
micro-batches: receive (plan, hidden) from upstream, run its layers, send
downstream; the last stage's shard 0 samples and returns the tokens to the
driver.  It exits when the driver says stop or when a peer disappears.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.kernels import get_attention_backend
from pagedq.workers.engine.sequence import Sequence
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.loader import resolve_model
from pagedq.workers.model.registry import build_model
from pagedq.workers.model.runner import ModelRunner, pick_device, unpack_step
from pagedq.workers.model.weights import load_weights
from pagedq.workers.parallel.distributed import (
    BusyLog,
    Kind,
    Link,
    Message,
    Replica,
    decode_json,
    encode_json,
    init_replica,
)
from pagedq.workers.parallel.executor import encode_sampled

log = logging.getLogger(__name__)


class StageWorker:
    def __init__(self, replica: Replica, runner: ModelRunner) -> None:
        self.replica = replica
        self.runner = runner
        self.link = Link(replica.world, replica.comm_device, runner.model.cfg.hidden_size, runner.dtype)
        self.samples = replica.is_last_stage and replica.shard_rank == 0
        self.seqs: dict[str, Sequence] = {}  # the sampling rank's copies: parameters, tokens, seeded generator
        self.busy = BusyLog()

    def serve(self) -> None:
        r = self.replica
        while True:
            msg = self.link.recv(r.upstream)
            if r.downstream is not None and msg.kind != Kind.BATCH:
                self.link.send(r.downstream, msg)
            if msg.kind == Kind.STOP:
                self.link.flush()
                return
            if msg.kind == Kind.STATS:
                self.link.send(0, Message(Kind.RESULT, control=encode_json(self.busy.take(), r.comm_device)))
            elif msg.kind == Kind.BATCH:
                self.busy.begin()
                self.run_batch(msg)
                self.busy.end()

    def run_batch(self, msg: Message) -> None:
        r = self.replica
        inputs = unpack_step(msg.plan.to(r.device))
        hidden = msg.hidden.to(r.device) if msg.hidden is not None else None
        hidden = self.runner.forward(inputs, hidden)
        if r.downstream is not None:
            self.link.send(r.downstream, Message(Kind.BATCH, msg.plan, msg.control, hidden))
        elif self.samples:
            control = decode_json(msg.control)
            seqs = self.update_sequences(control)
            inputs.prompt_spans = control.get("prompt", [])
            sampled = self.runner.sample(hidden, inputs, seqs)
            for seq, token in zip(seqs, sampled.token_ids, strict=True):
                seq.token_ids.append(token)
            self.link.send(0, Message(Kind.RESULT, control=encode_json(encode_sampled(sampled), r.comm_device)))

    def update_sequences(self, control: dict) -> list[Sequence]:
        for request_id in control["drop"]:
            self.seqs.pop(request_id, None)
        for request_id, prompt, params in control["new"]:
            self.seqs[request_id] = Sequence(request_id, prompt, SamplingParams(**params))
        return [self.seqs[request_id] for request_id in control["sample"]]


def load_stage(replica: Replica, model: str, settings: Settings) -> ModelRunner:
    spec = replica.spec
    source = resolve_model(model, settings.state_dir)
    cfg = ModelConfig.from_folder(source.path)
    if json.loads(json.dumps(cfg.__dict__)) != spec.model_config:
        raise ValueError(f"model {model!r} at {source.path} is not the model the driver serves ({spec.model})")
    dtype = getattr(torch, spec.dtype)
    attention = get_attention_backend(spec.attention_backend, replica.device)
    lm = build_model(cfg, load_weights(source.path), replica.layer_range, device=replica.device, dtype=dtype,
                  attention=attention, shard=replica.shard(cfg))
    return ModelRunner(lm, spec.num_blocks, spec.block_size, replica.device, dtype)


def stage_device(name: str, rank: int) -> torch.device:
    """``auto`` on a host with GPUs: the rank's GPU, round robin (one process per GPU)."""
    if name == "auto" and torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return pick_device(name)


def run_stage(rank: int, stages: int, tensor_parallel: int, master: str, model: str | None = None,
              device: str | None = None, threads: int | None = None, settings: Settings | None = None) -> None:
    settings = settings or Settings()
    threads = threads or settings.num_threads
    if threads:
        torch.set_num_threads(threads)
    dev = stage_device(device or settings.device, rank)
    replica = init_replica(rank, stages * tensor_parallel, master, dev, settings.stage_timeout_s,
                           backend=settings.dist_backend)
    failed = True
    try:
        runner = load_stage(replica, model or replica.spec.model, settings)
        log.info("rank %d: stage %d shard %d, layers %s on %s", rank, replica.stage, replica.shard_rank,
                 replica.layer_range, dev)
        StageWorker(replica, runner).serve()
        failed = False
    finally:
        replica.close(failed)


def serve_stage(rank: int, stages: int, tensor_parallel: int, master: str, model: str | None = None,
                device: str | None = None, threads: int | None = None) -> int:
    """Run one rank until the replica stops; the exit code.  ``pagedq stage`` and spawned stages call it."""
    logging.getLogger().setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 < rank < stages * tensor_parallel:
        log.error("--rank must be in 1 .. %d (rank 0 is the driver)", stages * tensor_parallel - 1)
        return 2
    try:
        run_stage(rank, stages, tensor_parallel, master, model, device, threads)
    except RuntimeError as e:  # a peer vanished: the replica is gone, and so is this process
        log.error("rank %d: replica lost: %s", rank, e)
        return 1
    return 0


if __name__ == "__main__":  # a stage spawned by its driver (PipelineExecutor): the spec is one JSON argument
    from pagedq.workers.processes import exit_process

    exit_process(serve_stage(**json.loads(sys.argv[1])))
