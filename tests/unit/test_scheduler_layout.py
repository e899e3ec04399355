"""Pure scheduling and layout logic: no model, no processes."""

from __future__ import annotations

import pytest

from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine.block_manager import BlockManager
from pagedq.workers.engine.executor import SamplerOutput, StepResult
from pagedq.workers.engine.scheduler import Scheduler
from pagedq.workers.engine.sequence import Sequence
from pagedq.workers.model.llama import ModelConfig, Shard
from pagedq.workers.parallel.distributed import ParallelConfig, balanced_split, layer_ranges, overlap_report


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


# --- layout: pure functions -------------------------------------------------------------------
def smollm_like(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                eos_token_ids=(2,), sliding_window=None)
    return ModelConfig(**{**base, **kw})


def test_uneven_heads_split_by_kv_groups():
    cfg = smollm_like()
    a, b = Shard.of(cfg, 0, 2), Shard.of(cfg, 1, 2)
    assert (a.kv_heads, a.q_heads, a.mlp) == ((0, 2), (0, 6), (0, 768))
    assert (b.kv_heads, b.q_heads, b.mlp) == ((2, 3), (6, 9), (768, 1536))
    with pytest.raises(ValueError, match="exceeds"):
        Shard.of(cfg, 0, 4)


def test_layer_split_charges_lm_head_to_the_last_stage():
    cfg = smollm_like()
    assert balanced_split(cfg, 2) == [17, 13]
    assert layer_ranges(cfg, 3) == [(0, 11), (11, 22), (22, 30)]
    assert layer_ranges(cfg, 2, [10, 20]) == [(0, 10), (10, 30)]
    with pytest.raises(ValueError):
        layer_ranges(cfg, 2, [10, 10])
    assert ParallelConfig(2, 2).rank_of(1, 1) == 3 and ParallelConfig(2, 2).sampler_rank == 2


def test_overlap_report_counts_time_with_two_busy():
    report = overlap_report([[(0, 6)], [(4, 10)]], 0, 10)
    assert report["busy"] == [0.6, 0.6] and report["overlap"] == pytest.approx(0.2)


def running_scheduler(num_seqs: int, num_blocks: int = 16) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose ``num_seqs`` sequences have computed their 3-token prompts and await a decode."""
    sched = Scheduler(BlockManager(num_blocks, block_size=4, enable_prefix_caching=False), max_num_seqs=16,
                      max_num_batched_tokens=64)
    seqs = [Sequence(f"s{i}", [1, 2, 3], greedy(8)) for i in range(num_seqs)]
    for s in seqs:
        sched.add(s)
    complete(sched, sched.schedule())
    return sched, seqs


def complete(sched: Scheduler, out) -> None:
    """The micro-batch comes back: every sequence whose prompt is computed gets token 7."""
    seqs = [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
    sched.update_from_output(StepResult(out, seqs, SamplerOutput([7] * len(seqs), [None] * len(seqs))))


def ids(out) -> list[str]:
    return [s.request_id for s, _ in out.scheduled]


def test_micro_batches_split_the_running_sequences_evenly():
    sched, _ = running_scheduler(5)
    first = sched.schedule(max_running=3)
    assert ids(first) == ["s0", "s1", "s2"]
    second = sched.schedule(max_running=3)  # the first micro-batch is still in flight
    assert ids(second) == ["s3", "s4"]
    assert sched.schedule(max_running=3).is_empty
    complete(sched, first)
    assert ids(sched.schedule(max_running=3)) == ["s0", "s1", "s2"]


def test_scheduler_never_schedules_or_preempts_busy_sequences():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=64)
    low = [Sequence(f"low{i}", [1, 2, 3], greedy(8), priority=0) for i in range(3)]
    for s in low:
        sched.add(s)
    sched.schedule()  # in flight from here on: busy
    high = [Sequence(f"high{i}", [1, 2, 3], greedy(8), priority=5) for i in range(3)]
    for s in high:
        sched.add(s)
    second = sched.schedule()
    assert ids(second) == ["high0", "high1", "high2"]
    # The busy sequences are now the least urgent running ones.  The urgent ones need a block each
    # and the pool has 2 free: the third must give way itself, not a busy sequence.
    complete(sched, second)
    for s in high:
        s.token_ids.append(7)  # two tokens to compute: 5 in all, a second block each
    third = sched.schedule()
    assert ids(third) == ["high0", "high1"]
    assert high[2].status.value == "waiting" and high[2].num_preemptions == 1
    assert all(s.status.value == "running" and s.block_table for s in low)


# --- pipeline stages ----------------------------------------------------------------------------
