"""Automatic prefix caching: same tokens with it on or off; blocks reused, counted, evicted LRU."""

from __future__ import annotations

import random

from engine_fixtures import fresh_engine, greedy, sharegpt_prompts

from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.engine.block_hash import cache_key, prefix_hashes
from pagedq.workers.engine.block_manager import NULL_BLOCK, BlockManager, PrefixHit
from pagedq.workers.engine.sequence import Sequence

SYSTEM = ("You are the support assistant of a company that runs message queues for machine learning jobs. "
          "Answer briefly, be precise about commands and never invent features. ") * 10


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_waves(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """First prompt alone (fills the cache), then the rest together."""
    first = engine.generate(prompts[:1], greedy(tokens))
    rest = engine.generate(prompts[1:], greedy(tokens))
    return [o.output_token_ids for o in first + rest]


def test_shared_system_prompt_same_tokens_fewer_computed():
    on, off = fresh_engine(enable_prefix_caching=True), fresh_engine(enable_prefix_caching=False)
    questions = ["How do I cancel a job?", "What is a priority queue?", "Can two workers share a GPU?",
                 "Why is my job still queued?", "How do I read results in Python?"]
    prompts = [chat_ids(on.tokenizer, q) for q in questions]
    assert len(prompts[0]) > 300
    assert run_waves(on, prompts, 24) == run_waves(off, prompts, 24)
    shared_blocks = len(chat_ids(on.tokenizer, "")) // 16 - 1
    assert on.stats.prefix_hits >= (len(prompts) - 1) * shared_blocks * 16
    assert on.stats.prompt_tokens_computed < off.stats.prompt_tokens_computed * 0.4


def test_repeated_identical_prompt():
    on, off = fresh_engine(enable_prefix_caching=True), fresh_engine(enable_prefix_caching=False)
    prompt = sharegpt_prompts()[4]
    outs_on = [on.generate([prompt], greedy(20))[0] for _ in range(3)]
    outs_off = [off.generate([prompt], greedy(20))[0] for _ in range(3)]
    assert [o.output_token_ids for o in outs_on] == [o.output_token_ids for o in outs_off]
    full = (len(prompt) - 1) // 16 * 16  # one token is always recomputed
    assert [o.num_cached_tokens for o in outs_on] == [0, full, full]
    assert all(o.num_cached_tokens == 0 for o in outs_off)


def test_prefix_ending_mid_block():
    on, off = fresh_engine(enable_prefix_caching=True), fresh_engine(enable_prefix_caching=False)
    base = sharegpt_prompts()[6][:45]
    variant = base[:37] + [random.randint(100, 40000) for _ in range(20)]  # diverges inside block 3
    for eng in (on, off):
        eng.generate([base], greedy(16))
    got = [on.generate([variant], greedy(16))[0], off.generate([variant], greedy(16))[0]]
    assert got[0].output_token_ids == got[1].output_token_ids
    assert got[0].num_cached_tokens == 32, "two full blocks shared, the third differs mid-block"


def test_cached_blocks_survive_until_evicted_in_lru_order():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True, extra_key="m")
    a, b = Sequence("a", list(range(1, 10)), SamplingParams()), Sequence("b", list(range(50, 59)), SamplingParams())
    for seq in (a, b):
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    assert bm.num_free_blocks == 0
    bm.free_sequence(a)  # a's 2 full blocks stay cached; its partial block is plain free
    bm.free_sequence(b)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 4
    again = Sequence("a2", list(range(1, 10)), SamplingParams())
    assert len(bm.find_cached_prefix(again)) == 2
    # a newcomer needing 3 fresh blocks takes the 2 empty ones first, then evicts one cached block:
    # the least recently freed sequence's tail block (its head is the part other prompts share)
    c = Sequence("c", list(range(200, 212)), SamplingParams())
    assert bm.allocate(c, 12)
    assert len(bm.cached) == 3
    assert len(bm.find_cached_prefix(Sequence("a3", list(range(1, 10)), SamplingParams()))) == 1
    assert len(bm.find_cached_prefix(Sequence("b2", list(range(50, 59)), SamplingParams()))) == 2


def test_a_sliding_group_frees_what_its_window_passed_and_a_hit_needs_only_its_last_blocks():
    """Groups (global, window 6) of 4-token blocks: after 25 tokens the sliding table keeps positions 20.. only;
    a later prompt with the same 24 first tokens adopts 6 global blocks and the sliding group's last 2; with
    the sliding group's 6th block evicted, the hit shrinks to the 5 blocks whose window is still cached."""
    bm = BlockManager(num_blocks=32, block_size=4, extra_key="m", windows=(None, 6))
    first = Sequence("a", list(range(1, 26)), SamplingParams())
    assert bm.allocate(first, 25)
    first.num_computed_tokens = 25
    bm.cache_full_blocks(first)
    bm.free_out_of_window(first)
    global_table, sliding = first.block_tables
    assert len(global_table) == len(sliding) == 7 and NULL_BLOCK not in global_table
    assert sliding[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in sliding[5:]  # keys >= 20 serve the query at 25
    assert bm.num_used_blocks == 9
    bm.free_sequence(first)
    assert bm.num_used_blocks == 0 and len(bm.cached) == len(bm.group_cached[1]) == 6

    second = Sequence("b", list(range(1, 26)) + [99], SamplingParams())
    hit = bm.find_cached_prefix(second)
    assert len(hit) == 6 and NULL_BLOCK not in hit.tables[0]
    assert hit.tables[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hit.tables[1][4:]
    assert bm.allocate(second, 2, hit) and second.num_computed_tokens == 24
    bm.free_sequence(second)

    evicted = bm.group_cached[1].pop(second.block_hashes[5])  # as eviction does
    bm.blocks[evicted].block_hash = None
    hit = bm.find_cached_prefix(Sequence("c", list(range(1, 26)) + [7], SamplingParams()))
    assert len(hit) == 5 and hit.tables[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in hit.tables[1][3:]


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = Sequence("1", list(range(1, 13)), SamplingParams())
    assert bm.allocate(first, 12)
    first.num_computed_tokens = 12
    bm.cache_full_blocks(first)
    second = Sequence("2", list(range(1, 13)) + [99], SamplingParams())
    hit = bm.find_cached_prefix(second)
    assert hit.tables == [first.block_table[:3]]
    assert bm.allocate(second, 1, hit)
    assert [bm.blocks[b].ref_count for b in hit.tables[0]] == [2, 2, 2]
    bm.free_sequence(first)
    assert [bm.blocks[b].ref_count for b in hit.tables[0]] == [1, 1, 1] and bm.num_used_blocks == 4
    bm.free_sequence(second)
    assert bm.num_used_blocks == 0


def test_prefix_cache_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s = Sequence("1", list(range(1, 13)), SamplingParams())
    bm.allocate(s, 12)
    s.num_computed_tokens = 12
    bm.cache_full_blocks(s)
    assert bm.find_cached_prefix(Sequence("2", list(range(1, 13)), SamplingParams())) == PrefixHit() and not bm.cached


def test_n_choices_compute_the_prompt_once():
    """n > 1: the other choices wait until choice 0 has computed the prompt, then take its blocks."""
    eng = fresh_engine()
    bs = eng.settings.block_size
    prompt = random.choice([p for p in sharegpt_prompts() if len(p) > 3 * bs])
    seed = random.randrange(1 << 32)
    sampled = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
    [out] = eng.generate([prompt], sampled)
    answers = [o.output_token_ids for o in [out, *out.others]]
    assert [len(a) for a in answers] == [10] * 4 and len({tuple(a) for a in answers}) > 1
    full = (len(prompt) - 1) // bs * bs  # the last token always runs: its block is computed again
    assert eng.stats.prefix_hits == 3 * full
    assert eng.stats.prompt_tokens_computed == len(prompt) + 3 * (len(prompt) - full)
    [again] = eng.generate([prompt], sampled)
    assert [o.output_token_ids for o in [again, *again.others]] == answers, "seeded choices are reproducible"

    [greedy_n] = eng.generate([prompt], greedy(6, n=3))
    [one] = eng.generate([prompt], greedy(6))
    assert [o.output_token_ids for o in [greedy_n, *greedy_n.others]] == [one.output_token_ids] * 3


def test_aborting_a_request_ends_its_held_choices():
    eng = fresh_engine().engine
    prompt = sharegpt_prompts()[0]
    eng.add_request("r", prompt, greedy(8, n=3))
    eng.abort_request("r")
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
    assert sorted(outs) == ["r", "r#1", "r#2"]
    assert all(o.finished and o.finish_reason == "abort" for o in outs.values())


def test_the_cpu_side_names_a_prompts_blocks_as_the_engine_does():
    """``prefix_hashes`` (what the CPU worker can compute from a prompt's token ids) is the chain the engine's
    prefix cache files the prompt's blocks under: the blocks a repeat of the prompt finds cached."""
    for _ in range(40):
        block_size = random.choice([4, 16])
        key = cache_key("some/model", f"{random.getrandbits(64):016x}")
        prompt = [random.randint(1, 49151) for _ in range(random.randint(1, 120))]
        names = prefix_hashes(prompt, block_size, key)
        assert len(names) == (len(prompt) - 1) // block_size
        bm = BlockManager(num_blocks=64, block_size=block_size, extra_key=key)
        first = Sequence("1", prompt, SamplingParams())
        assert len(bm.find_cached_prefix(first)) == 0
        assert first.block_hashes == names
        assert bm.allocate(first, first.num_tokens)
        first.num_computed_tokens = first.num_tokens
        bm.cache_full_blocks(first)
        assert set(names) <= set(bm.cached)
        assert len(bm.find_cached_prefix(Sequence("2", prompt, SamplingParams()))) == len(names)
        limit = random.randint(0, 5)
        assert prefix_hashes(prompt, block_size, key, limit) == names[:limit]
        other = prefix_hashes(prompt, block_size, cache_key("some/model", "other-weights"))
        assert not set(other) & set(names)


def test_the_cache_changes_a_worker_publishes_keep_a_copy_equal_to_the_cache():
    """``take_changes`` after each step, applied to a copy (as the worker's Redis set is), leaves the copy equal
    to the prefix cache through allocations, frees and LRU evictions."""
    bm = BlockManager(num_blocks=12, block_size=4, extra_key="m")
    bm.track_changes()
    copy: set[bytes] = set()
    live: list[Sequence] = []
    evicted_seen = 0
    for step in range(300):
        if live and (len(live) > 3 or random.random() < 0.4):
            bm.free_sequence(live.pop(random.randrange(len(live))))
        else:
            prefix = random.choice([[7, 8, 9, 10, 11, 12, 13, 14], [21, 22, 23, 24], []])
            seq = Sequence(str(step), prefix + [random.randint(100, 999) for _ in range(random.randint(1, 10))],
                           SamplingParams())
            hit = bm.find_cached_prefix(seq)
            if bm.allocate(seq, seq.num_tokens - len(hit) * 4, hit):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
        cached, evicted = bm.take_changes()
        assert not set(cached) & set(evicted)
        evicted_seen += len(evicted)
        copy = (copy - set(evicted)) | set(cached)
        assert copy == set(bm.cached)
    assert evicted_seen > 0, "the pool is small enough that cached blocks were evicted"
