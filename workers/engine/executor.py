"""What the engine core asks of whoever runs the model: the ``Executor`` protocol.

The core hands an executor scheduled micro-batches (``submit``) and takes their
sampled tokens back in submission order (``collect``).  One process runs a
step at once (``LocalExecutor``, one in flight); a replica of pipeline stages
keeps up to one micro-batch per stage in flight (``PipelineExecutor``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedq.workers.engine.scheduler import SchedulerOutput
    from pagedq.workers.engine.sequence import Sequence


class ReplicaLostError(RuntimeError):
    """A process of the model's replica died or went silent; the engine cannot step any more."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": (id, logprob), "top": [(id, logprob), ...]}
    # Prompt tokens scored this step (``workers.model.prompt_logprobs``): [request id, first position, entries].
    prompt_logprobs: list[list] = field(default_factory=list)


@dataclass
class StepResult:
    sched: SchedulerOutput
    seqs: list[Sequence]  # the sequences that got a token, in ``sampled`` order
    sampled: SamplerOutput


class Executor(Protocol):
    max_inflight: int  # micro-batches that may be in flight at once

    @property
    def num_blocks(self) -> int: ...  # KV blocks every process of the replica holds

    @property
    def num_inflight(self) -> int: ...

    def submit(self, sched: SchedulerOutput) -> None: ...

    def collect(self) -> StepResult: ...  # the oldest micro-batch's tokens

    def forget(self, request_id: str) -> None: ...  # the request left the engine

    def check(self) -> None: ...  # raise ReplicaLostError if a process of the replica died

    def shutdown(self) -> None: ...
