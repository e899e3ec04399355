"""How to pick the next token, and when to stop: what a GenerateJob carries to the engine.

A plain record: what is valid is decided once, at the edge, by the request
schema (``pagedq.pipeline.protocol``), which builds these.  ``stop`` strings
are matched on text by the detokenizer outside the engine core; the core
stops on token ids (EOS, ``stop_token_ids``) and on length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (dividing logits by it would overflow).
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    n: int = 1  # answers to the one prompt; the engine computes the prompt once (``LLMEngine``)
    max_tokens: int = 16  # 0: nothing generated (the prompt is only scored: ``prompt_logprobs``, ``echo``)
    temperature: float = 1.0  # < GREEDY_EPSILON = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off; larger than the vocabulary = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    # vLLM's: top-N logprobs of every prompt token (each token's own beside them); None: not computed.
    prompt_logprobs: int | None = None
    echo: bool = False  # the answer starts with the prompt (OpenAI's completions ``echo``): postprocess's business
    include_stop_str_in_output: bool = False
    # ``[kind, text]`` the output must follow (``pagedq.config.constraints``), or None: free text.
    # A list of strings, not an object, so it crosses processes as plain JSON.
    constraint: list[str] | None = None
    # Token id -> bias added to its logit after the penalties (OpenAI's logit_bias); ids < the vocabulary.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Whose prefix-cache blocks the prompt may reuse (vLLM's ``cache_salt``): part of every block's name
    # (``workers.engine.block_hash``); "": the unsalted blocks.  The gateway sets it to the tenant's scope.
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.logit_bias:  # JSON (a stage's copy of the params) turns the token ids into strings
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: the engine looks each generated token up in it."""
        return frozenset(self.stop_token_ids)

    @property
    def max_output_tokens(self) -> int:
        """The most tokens the request can generate: ``max_tokens`` for each of its ``n`` choices."""
        return self.n * self.max_tokens

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top-N logprobs the engine computes for each prompt token (``prompt_logprobs``, or ``logprobs`` of an
        ``echo``ed prompt, whichever is larger); None: the prompt is not scored."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
