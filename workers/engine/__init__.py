"""The engine core: a library with no I/O (no celery, kombu, redis or tokenizer).

``LLMEngine`` steps a continuous batch: ``Scheduler`` (over ``BlockManager``)
plans each step, an ``Executor`` runs it, ``Scheduler.update_from_output``
does the bookkeeping.  Build one from Settings with ``pagedq.workers.llm.LLM``.
"""

from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine.block_manager import BlockManager
from pagedq.workers.engine.executor import Executor, ReplicaLostError, SamplerOutput, StepResult
from pagedq.workers.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from pagedq.workers.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedq.workers.engine.sequence import Sequence, SequenceStatus

__all__ = ["BlockManager", "EngineConfig", "Executor", "LLMEngine", "ReplicaLostError", "RequestOutput",
           "SamplerOutput", "SamplingParams", "Scheduler", "SchedulerOutput", "SchedulerStats", "Sequence",
           "SequenceStatus", "StepResult"]
