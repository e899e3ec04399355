"""The engine core: a library with no I/O (no celery, kombu, redis or tokenizer).

``LLMEngine`` steps a continuous batch: ``Scheduler`` (over ``BlockManager``)
plans each step, an ``Executor`` runs it, ``Scheduler.update_from_output``
does the bookkeeping.  Build one from Settings with ``pagedq.workers.llm.LLM``.

The names below are imported on first use (PEP 562), so that importing one
torch-free module of the core (``block_hash``, from the CPU worker) does not
load torch with the rest.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BlockManager": "block_manager", "EngineConfig": "llm_engine", "Executor": "executor",
    "LLMEngine": "llm_engine", "ReplicaLostError": "executor", "RequestOutput": "llm_engine",
    "SamplerOutput": "executor", "SamplingParams": "pagedq.config.sampling_params", "Scheduler": "scheduler",
    "SchedulerOutput": "scheduler", "SchedulerStats": "scheduler", "Sequence": "sequence",
    "SequenceStatus": "sequence", "StepResult": "executor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), name)
