"""The engine core with a scripted executor: no model, no tokenizer, no I/O.

The executor "samples" a token that depends only on the sequence's length, so a
request's output is the same whatever runs beside it; it raises for requests
the test marks as poison.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine import EngineConfig, LLMEngine, SamplerOutput, SchedulerOutput, StepResult

VOCAB = 1000


class ScriptedExecutor:
    """Next token = (sum of the sequence's tokens) mod VOCAB; raises when a poison request is in the batch."""

    max_inflight = 1

    def __init__(self, num_blocks: int = 256, poison: set[str] | None = None) -> None:
        self._num_blocks = num_blocks
        self.poison = poison or set()
        self.done: deque[StepResult] = deque()
        self.batches: list[list[str]] = []

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_inflight(self) -> int:
        return len(self.done)

    def submit(self, sched: SchedulerOutput) -> None:
        ids = [s.request_id for s, _ in sched.scheduled]
        self.batches.append(ids)
        if self.poison & set(ids):
            raise ValueError(f"injected fault for {sorted(self.poison & set(ids))}")
        seqs = [s for s, n in sched.scheduled if s.num_computed_tokens + n == s.num_tokens]
        tokens = [sum(s.token_ids) % VOCAB for s in seqs]
        self.done.append(StepResult(sched, seqs, SamplerOutput(tokens, [None] * len(seqs))))

    def collect(self) -> StepResult:
        return self.done.popleft()

    def forget(self, request_id: str) -> None:
        pass

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_engine(executor: ScriptedExecutor, **kw) -> LLMEngine:
    config = EngineConfig(model_name="scripted", fingerprint="f", max_model_len=4096, vocab_size=VOCAB,
                          eos_token_ids=frozenset({VOCAB + 1}), block_size=4, max_num_batched_tokens=64, **kw)
    return LLMEngine(config, executor)


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(sum(tokens) % VOCAB)
    return tokens[len(prompt):]


def prompts(k: int) -> list[list[int]]:
    return [[random.randrange(1, VOCAB) for _ in range(random.randrange(3, 40))] for _ in range(k)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def test_a_step_that_raises_fails_only_the_request_that_caused_it():
    executor = ScriptedExecutor(poison={"r3"})
    engine = make_engine(executor)
    ps = prompts(6)
    out = engine.run([(f"r{i}", p, greedy(12), 0) for i, p in enumerate(ps)])
    assert out["r3"].finish_reason == "error" and "injected fault" in out["r3"].error
    for i, p in enumerate(ps):
        if i != 3:
            assert out[f"r{i}"].finish_reason == "length"
            assert out[f"r{i}"].output_token_ids == expected_output(p, 12), f"r{i}"
    # The culprit was found by running the failed step's requests alone, then the rest went on together.
    assert ["r3"] in executor.batches
    assert any(len(b) > 1 and "r3" not in b for b in executor.batches[executor.batches.index(["r3"]):])
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_a_request_alone_that_raises_fails_at_once():
    executor = ScriptedExecutor(poison={"only"})
    engine = make_engine(executor)
    out = engine.run([("only", prompts(1)[0], greedy(5), 0)])
    assert out["only"].finish_reason == "error" and len(executor.batches) == 1


def test_finish_request_ends_a_request_from_outside():
    engine = make_engine(ScriptedExecutor())
    p = prompts(1)[0]
    engine.add_request("a", p, greedy(50))
    for _ in range(4):
        engine.step()
    engine.finish_request("a", "stop", "STOP")
    [out] = [o for o in engine.step() if o.request_id == "a"]
    assert out.finished and out.finish_reason == "stop" and out.stop_reason == "STOP"
    assert out.output_token_ids == expected_output(p, 4) and out.new_token_ids == []  # a token a step, then the stop
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_outputs_do_not_depend_on_batch_mates(policy):
    ps = prompts(12)
    engine = make_engine(ScriptedExecutor(num_blocks=40), max_num_seqs=5, scheduling_policy=policy)
    out = engine.run([(f"r{i}", p, greedy(20), random.randrange(10)) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert out[f"r{i}"].output_token_ids == expected_output(p, 20)
    assert engine.stats.generated_tokens == 12 * 20
    assert policy == "fcfs" or engine.stats.preemptions > 0, "the small KV pool should force preemptions"
    fresh = engine.reset_stats()
    assert fresh.generated_tokens == 240 and engine.stats.generated_tokens == 0


def test_n_choices_run_under_their_own_ids_and_a_failing_choice_0_ends_the_held_ones():
    engine = make_engine(ScriptedExecutor(poison={"bad"}))
    p, q = prompts(2)
    out = engine.run([("a", p, SamplingParams(n=3, max_tokens=6, temperature=0), 0),
                      ("bad", q, SamplingParams(n=2, max_tokens=6, temperature=0), 0)])
    assert sorted(out) == ["a", "a#1", "a#2", "bad", "bad#1"]
    assert [out[i].output_token_ids for i in ("a", "a#1", "a#2")] == [expected_output(p, 6)] * 3
    assert out["bad"].finish_reason == "error" and out["bad#1"].finish_reason == "error"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
