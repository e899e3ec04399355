"""How to pick the next token, and when to stop."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine cannot run; the message names the offending field."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             "top_k must be -1 (off) or an integer >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= 16, "stop takes at most 16 strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "logprobs must be an integer in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def deterministic(self) -> bool:
        return self.greedy or self.seed is not None
