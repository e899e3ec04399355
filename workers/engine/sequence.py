"""One request inside the engine: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import itertools
from enum import Enum
from typing import Protocol

import torch

from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import DEFAULT_TENANT, SchedulingMeta

_arrivals = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Grammar(Protocol):
    """A sequence's place in its output grammar (``pagedq.workers.grammar.GrammarState``); opaque to the core."""

    def fill(self, bitmask: torch.Tensor, row: int, output_token_ids: list[int]) -> None:
        """Write into ``bitmask[row]`` the tokens allowed after ``output_token_ids``."""


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, meta: SchedulingMeta | None = None, grammar: Grammar | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params = params
        self.priority = priority  # higher = more urgent
        self.tenant = meta.tenant if meta else DEFAULT_TENANT  # whose service this sequence is charged to
        self.deadline = meta.deadline if meta else None  # latest start (seconds since the epoch), or None
        self.arrival = next(_arrivals)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_tables: list[list[int]] = []  # per KV group (``kv_layout.py``); set at the first allocation
        self.block_hashes: list[bytes] = []  # hash chain of this sequence's full blocks (prefix cache)
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None  # what its step raised, when it ended with finish_reason "error"
        self.logprobs: list[dict] = []
        # Per prompt token, in order, as the prefill computes them (the first token's None: nothing precedes it);
        # None when the request does not score its prompt (``params.num_prompt_logprobs``).
        self.prompt_logprobs: list[dict | None] | None = None if params.num_prompt_logprobs is None else [None]
        self.grammar = grammar  # set when params.constraint is: the sampler masks what it does not allow
        self.logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # the sampler's, built once
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def block_table(self) -> list[int]:
        """The first KV group's blocks: a model without sliding windows has only that group."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens' logprobs are still to compute: its prompt must not come from the prefix cache."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, prio={self.priority}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
