"""Engine behaviour: continuous batching, priority, chunked prefill, aborts, KV accounting."""

from __future__ import annotations

import threading

from engine_fixtures import engine, fresh_engine, greedy, sharegpt_prompts

from pagedq.config.sampling_params import SamplingParams


def run_until_finished(eng, on_step=None) -> tuple[list[str], int]:
    """Step until idle; returns request ids in finishing order and the number of steps."""
    order, steps = [], 0
    while eng.has_unfinished():
        outs = eng.step()
        steps += 1
        order += [o.request_id for o in outs if o.finished]
        if on_step:
            on_step(steps, outs)
    return order, steps


def test_request_added_mid_decode_gets_its_first_token_next_step():
    eng = engine()
    prompts = sharegpt_prompts()
    for i in range(4):
        eng.add_request(f"long{i}", prompts[i], greedy(40))
    for _ in range(6):  # all four are now decoding
        outs = eng.step()
    assert {o.request_id for o in outs} == {f"long{i}" for i in range(4)}
    eng.add_request("late", prompts[5], greedy(3))
    outs = {o.request_id: o for o in eng.step()}
    assert "late" in outs and len(outs["late"].new_token_ids) == 1, "the newcomer joined the running batch"
    assert all(f"long{i}" in outs for i in range(4)), "running requests kept decoding in the same step"
    order, _ = run_until_finished(eng)
    assert order.index("late") < min(order.index(f"long{i}") for i in range(4))


def test_short_request_finishes_before_long_ones_that_started_earlier():
    eng = engine()
    prompts = sharegpt_prompts()
    for i in range(3):
        eng.add_request(f"long{i}", prompts[i], greedy(30))
    eng.step()
    eng.add_request("short", prompts[3], greedy(2))
    order, _ = run_until_finished(eng)
    assert order[0] == "short"


def test_high_priority_request_admitted_last_finishes_first():
    eng = fresh_engine(max_num_seqs=2)  # saturated: two seats
    prompts = sharegpt_prompts()
    for i in range(6):
        eng.add_request(f"low{i}", prompts[i], greedy(12), priority=0)
    eng.step()
    eng.step()
    eng.add_request("urgent", prompts[7], greedy(12), priority=9)
    order, _ = run_until_finished(eng)
    assert order.index("urgent") < min(order.index(f"low{i}") for i in range(2, 6)), order
    # it took a seat from a running low-priority request rather than waiting for one to free up
    assert order.index("urgent") <= 1, order


def test_fcfs_policy_ignores_priority():
    eng = fresh_engine(max_num_seqs=2, scheduling_policy="fcfs")
    prompts = sharegpt_prompts()
    for i in range(4):
        eng.add_request(f"low{i}", prompts[i], greedy(6), priority=0)
    eng.step()
    eng.add_request("urgent", prompts[7], greedy(6), priority=9)
    order, _ = run_until_finished(eng)
    assert order[-1] == "urgent"


def test_long_prompt_is_prefilled_in_chunks_without_changing_output():
    prompt = sum(sharegpt_prompts(), [])[:700]
    whole = engine().generate([prompt], greedy(8))[0].output_token_ids
    eng = fresh_engine(max_num_batched_tokens=128, enable_prefix_caching=False)
    eng.add_request("long", prompt, greedy(8))
    computed, final = [], None
    while eng.has_unfinished():
        outs = eng.step()
        if "long" in eng.requests:
            computed.append(eng.requests["long"].num_computed_tokens)
        final = next((o for o in outs if o.finished), final)
    assert computed[:6] == [128, 256, 384, 512, 640, 700], computed
    assert final.output_token_ids == whole


def test_abort_from_another_thread_frees_blocks():
    eng = fresh_engine()
    prompts = sharegpt_prompts()
    for i in range(3):
        eng.add_request(f"r{i}", prompts[i], greedy(200))
    eng.step()
    eng.step()
    used = eng.block_manager.num_used_blocks
    assert used > 0
    t = threading.Thread(target=eng.abort_request, args=("r1",))
    t.start()
    t.join()
    outs = {o.request_id: o for o in eng.step()}
    assert outs["r1"].finished and outs["r1"].finish_reason == "abort"
    assert "r1" not in eng.requests
    for rid in ("r0", "r2"):
        eng.abort_request(rid)
    eng.step()
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()


def test_add_request_from_other_threads_while_stepping():
    eng = engine()
    prompts = sharegpt_prompts()
    finished: dict[str, list[int]] = {}
    stop = threading.Event()

    def loop():
        while not stop.is_set() or eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = o.output_token_ids

    stepper = threading.Thread(target=loop)
    stepper.start()
    producers = [threading.Thread(target=eng.add_request, args=(f"t{i}", prompts[i], greedy(5))) for i in range(8)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    stop.set()
    stepper.join(timeout=120)
    assert sorted(finished) == sorted(f"t{i}" for i in range(8))
    assert all(len(v) == 5 for v in finished.values())


def test_kv_accounting_reports_blocks_vs_tokens():
    eng = fresh_engine()
    prompts = sharegpt_prompts()[:10]
    eng.generate(prompts, greedy(20))
    st = eng.stats
    assert st.kv_slots_allocated > st.kv_tokens_stored > 0
    # waste is bounded by one partly filled block per running sequence
    assert 0 < st.kv_waste_fraction < 16 / (sum(map(len, prompts)) / len(prompts))
    assert eng.block_manager.num_used_blocks == 0


def test_finish_reasons_and_stop_conditions():
    eng = engine()
    tok = eng.tokenizer
    prompt = tok("The numbers one, two, three, four, five", add_special_tokens=False)["input_ids"]
    free_run = eng.generate([prompt], greedy(20))[0]
    assert free_run.finish_reason == "length" and len(free_run.output_token_ids) == 20
    text = tok.decode(free_run.output_token_ids)
    stop_word = text.split()[1]
    stopped = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop_word]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_word
    assert len(stopped.output_token_ids) < 20
    stop_token = free_run.output_token_ids[3]
    by_token = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_token]))[0]
    assert by_token.output_token_ids == free_run.output_token_ids[:4] and by_token.stop_reason == stop_token
