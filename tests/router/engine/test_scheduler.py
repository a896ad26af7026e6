"""Scheduler: admission, chunked prefill, decode growth, prefix hits, abort, preemption,
the step protocol and budget adaptation, driven by a fake model that checks the KV cache
it is given."""

from __future__ import annotations

import pytest

from textgate.router.engine.scheduler import Scheduler
from textgate.router.engine.step_types import ModelStepResult, SchedulerOutput
from textgate.tests.router.engine.scheduler_helpers import (
    FakeModel,
    add,
    make,
    next_token,
    spans,
    step,
)

# ---- admission and prefill ----


def test_admission_schedules_whole_prompts_that_fit() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, [1, 2, 3, 4, 5, 6])
    add(scheduler, model, 2, [7, 8, 9])
    output = scheduler.schedule()
    assert output.new_request_ids == (1, 2)
    assert output.preempted_ids == output.finished_ids == ()
    assert spans(output) == {1: (0, 6, True), 2: (0, 3, True)}
    first = output.scheduled[0]
    assert first.token_ids == (1, 2, 3, 4, 5, 6)
    assert len(first.block_table) == 2
    assert first.slot_mapping[4] == first.block_table[1] * 4
    assert scheduler.num_running == 2 and scheduler.num_waiting == 0
    scheduler.update(model.run(output))
    assert scheduler.output_token_ids(1) == (next_token(1, 6),)


def test_admission_reserves_decode_room_capped_by_max_new_tokens() -> None:
    scheduler, model = make(num_reserved_tokens=5)
    add(scheduler, model, 1, [1, 2, 3, 4], max_new=8)
    add(scheduler, model, 2, [1, 2, 3, 5], max_new=2)
    output = scheduler.schedule()
    assert len(output.scheduled[0].block_table) == 3  # 4 + 5 tokens
    assert len(output.scheduled[1].block_table) == 2  # 4 + 2 tokens, not 4 + 5


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    scheduler, model = make(max_num_batched_tokens=4, max_num_seqs=2)
    add(scheduler, model, 1, list(range(10)))
    assert spans(step(scheduler, model)) == {1: (0, 4, False)}
    add(scheduler, model, 2, [20, 21, 22])
    assert spans(step(scheduler, model)) == {1: (4, 8, False)}
    # The prompt's last chunk leaves budget for the next request's first chunk.
    output = step(scheduler, model)
    assert spans(output) == {1: (8, 10, True), 2: (0, 2, False)}
    assert output.new_request_ids == (2,)
    assert spans(step(scheduler, model)) == {1: (10, 11, True), 2: (2, 3, True)}
    assert scheduler.output_token_ids(1) == (next_token(1, 10), next_token(1, 11))


def test_decodes_come_before_prefill_chunks() -> None:
    scheduler, model = make(max_num_batched_tokens=8, max_num_seqs=4)
    add(scheduler, model, 1, [1, 2, 3])
    step(scheduler, model)
    add(scheduler, model, 2, list(range(30)))
    output = step(scheduler, model)
    assert [s.request_id for s in output.scheduled] == [1, 2]
    assert spans(output) == {1: (3, 4, True), 2: (0, 7, False)}


def test_max_num_seqs_limits_the_running_batch() -> None:
    scheduler, model = make(max_num_seqs=2)
    for rid in (1, 2, 3):
        add(scheduler, model, rid, [rid], max_new=2)
    assert step(scheduler, model).new_request_ids == (1, 2)
    assert scheduler.num_waiting == 1
    step(scheduler, model)  # 1 and 2 reach max_new_tokens
    output = step(scheduler, model)
    assert output.finished_ids == (1, 2)
    assert output.new_request_ids == (3,)


def test_the_head_of_the_queue_is_not_overtaken() -> None:
    scheduler, model = make(num_blocks=4)
    add(scheduler, model, 1, list(range(8)), max_new=2)  # 2 blocks
    add(scheduler, model, 2, list(range(50, 62)), max_new=2)  # 3 blocks: must wait
    add(scheduler, model, 3, [1], max_new=2)  # would fit, but arrived later
    assert step(scheduler, model).new_request_ids == (1,)
    assert scheduler.num_waiting == 2
    assert step(scheduler, model).new_request_ids == ()  # 3 fits, but 2 is first in line
    assert step(scheduler, model).new_request_ids == (2, 3)


def test_reject_a_request_that_could_never_fit() -> None:
    scheduler, _ = make()  # 16 blocks of 4 tokens
    with pytest.raises(ValueError, match="whole cache holds 64"):
        scheduler.add_request(1, list(range(60)), 5)
    scheduler.add_request(2, list(range(60)), 4)
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(2, [1], 1)
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request(3, [], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        scheduler.add_request(4, [1], 0)
    assert not scheduler.has_request(1) and scheduler.has_request(2)


# ---- decode ----


def test_decode_grows_the_table_when_crossing_a_block_boundary() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, [1, 2, 3, 4], max_new=10)
    assert len(step(scheduler, model).scheduled[0].block_table) == 1
    tables = [step(scheduler, model).scheduled[0] for _ in range(5)]
    assert [len(s.block_table) for s in tables] == [2, 2, 2, 2, 3]
    assert [s.start_position for s in tables] == [4, 5, 6, 7, 8]
    assert tables[0].slot_mapping == (tables[0].block_table[1] * 4,)


def test_max_new_tokens_ends_a_request_the_shard_did_not_stop() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, [1, 2], max_new=3)
    for _ in range(3):
        step(scheduler, model)
    assert not scheduler.has_request(1)
    assert model.outputs(1) == [next_token(1, p) for p in (2, 3, 4)]
    output = scheduler.schedule()
    assert output.finished_ids == (1,)
    assert scheduler.schedule().finished_ids == ()  # reported once
    assert scheduler.allocator.num_used_blocks == 0


def test_the_shards_stopping_criteria_finish_a_request() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, [1, 2], max_new=30)
    model.finish_after[1] = 2
    assert scheduler.update(model.run(scheduler.schedule())) == ()
    assert scheduler.has_request(1)
    assert scheduler.update(model.run(scheduler.schedule())) == (1,)
    assert not scheduler.has_request(1)
    assert scheduler.allocator.num_used_blocks == 0


# ---- prefix caching ----


def test_prefix_hit_shares_blocks_and_skips_computed_tokens() -> None:
    scheduler, model = make()
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    add(scheduler, model, 1, [*shared, 9, 10])
    first = step(scheduler, model).scheduled[0]
    add(scheduler, model, 2, [*shared, 11, 12, 13])
    second = step(scheduler, model).scheduled[1]
    assert second.request_id == 2
    assert (second.start_position, second.token_ids) == (8, (11, 12, 13))
    assert second.block_table[:2] == first.block_table[:2]
    assert second.produces_token
    assert scheduler.allocator.num_prefix_hit_tokens == 8
    assert scheduler.allocator.num_prefix_query_tokens == 10 + 11


def test_prefix_hit_on_a_finished_request_recomputes_only_the_last_token() -> None:
    scheduler, model = make()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    add(scheduler, model, 1, prompt, max_new=1)
    step(scheduler, model)
    assert not scheduler.has_request(1)
    add(scheduler, model, 2, prompt, max_new=1)
    # Both blocks are cached, but the last token is recomputed for its logits.
    assert spans(step(scheduler, model)) == {2: (4, 8, True)}


def test_prefix_caching_can_be_disabled() -> None:
    scheduler, model = make(enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    add(scheduler, model, 1, prompt, max_new=1)
    step(scheduler, model)
    add(scheduler, model, 2, prompt, max_new=1)
    assert spans(step(scheduler, model)) == {2: (0, 9, True)}


def test_copies_of_a_prompt_wait_for_its_prefill_then_hit_its_blocks() -> None:
    scheduler, model = make()
    prompt = list(range(1, 11))  # two full blocks of 4, and 2 tokens
    add(scheduler, model, 1, prompt)
    add(scheduler, model, 2, prompt, copies=1)
    add(scheduler, model, 3, prompt, copies=1)
    add(scheduler, model, 4, [40, 41])  # behind the copies: first come, first served
    assert spans(step(scheduler, model)) == {1: (0, 10, True)}
    output = step(scheduler, model)
    assert spans(output) == {1: (10, 11, True), 2: (8, 10, True), 3: (8, 10, True), 4: (0, 2, True)}
    assert scheduler.allocator.num_prefix_hit_tokens == 16


def test_a_copy_does_not_wait_for_a_chunked_prefill_past_the_shared_blocks() -> None:
    scheduler, model = make(max_num_batched_tokens=6, max_num_seqs=2)
    prompt = list(range(1, 12))  # blocks [0, 8) shared; the copy waits until they are done
    add(scheduler, model, 1, prompt)
    add(scheduler, model, 2, prompt, copies=1)
    assert spans(step(scheduler, model)) == {1: (0, 6, False)}
    assert spans(step(scheduler, model)) == {1: (6, 11, True)}
    assert spans(step(scheduler, model)) == {1: (11, 12, True), 2: (8, 11, True)}


def test_a_copy_runs_alone_when_its_original_is_gone_or_not_running() -> None:
    scheduler, model = make()
    prompt = list(range(1, 11))
    add(scheduler, model, 1, prompt)
    add(scheduler, model, 2, prompt, copies=1)
    scheduler.abort(1)
    assert spans(step(scheduler, model)) == {2: (0, 10, True)}
    # An original still waiting (behind its preempted copy) computes nothing: no wait.
    scheduler, model = make()
    add(scheduler, model, 5, [7, 7, 7])
    add(scheduler, model, 6, [1, 2, 3, 4, 5], copies=5)
    assert scheduler._awaits_prompt(scheduler._requests[6]) is False


def test_copies_share_nothing_without_prefix_caching() -> None:
    scheduler, model = make(enable_prefix_caching=False)
    prompt = list(range(1, 11))
    add(scheduler, model, 1, prompt)
    add(scheduler, model, 2, prompt, copies=1)
    assert spans(step(scheduler, model)) == {1: (0, 10, True), 2: (0, 10, True)}


# ---- abort ----


def test_abort_frees_a_running_request_within_the_step() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, list(range(9)))
    add(scheduler, model, 2, [1, 2])
    step(scheduler, model)
    used = scheduler.allocator.num_used_blocks
    assert scheduler.abort(1)
    assert scheduler.allocator.num_used_blocks == used - 3
    assert not scheduler.has_request(1)
    output = step(scheduler, model)
    assert output.finished_ids == (1,)
    assert [s.request_id for s in output.scheduled] == [2]


def test_abort_during_an_in_flight_step_ignores_its_result() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, [1, 2, 3])
    add(scheduler, model, 2, [4, 5, 6])
    output = scheduler.schedule()
    assert scheduler.abort(2)
    scheduler.update(model.run(output))  # the shard still reports request 2
    scheduler.check_invariants()
    assert scheduler.output_token_ids(1) == (next_token(1, 3),)
    assert scheduler.schedule().finished_ids == (2,)


def test_abort_of_waiting_and_unknown_requests() -> None:
    scheduler, model = make(max_num_seqs=1)
    add(scheduler, model, 1, [1])
    add(scheduler, model, 2, [2])
    step(scheduler, model)
    assert scheduler.abort(2)
    assert not scheduler.abort(2)
    assert not scheduler.abort(99)
    assert scheduler.num_waiting == 0
    assert step(scheduler, model).finished_ids == ()  # the shards never saw request 2


# ---- preemption ----


def run_until_done(
    scheduler: Scheduler, model: FakeModel, limit: int = 200
) -> list[SchedulerOutput]:
    outputs: list[SchedulerOutput] = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < limit, "the scheduler stopped making progress"
        outputs.append(step(scheduler, model))
    return outputs


def test_preemption_recomputes_the_newest_request_with_its_tokens() -> None:
    scheduler, model = make(num_blocks=5)  # 20 tokens of cache
    add(scheduler, model, 1, [1, 2, 3, 4], max_new=12)
    add(scheduler, model, 2, [5, 6, 7, 8], max_new=12)
    outputs = run_until_done(scheduler, model)
    preempting = next(i for i, output in enumerate(outputs) if output.preempted_ids)
    assert outputs[preempting].preempted_ids == (2,)
    assert all(1 not in output.preempted_ids for output in outputs)
    assert 2 not in spans(outputs[preempting])
    # Request 2 comes back with prompt + generated tokens as its prompt; the fake
    # model checked that the recomputed tokens are exactly the ones it had.
    resumed = next(o for o in outputs[preempting:] if 2 in o.new_request_ids)
    resume = next(s for s in resumed.scheduled if s.request_id == 2)
    assert resume.produces_token
    assert resume.end_position > 4
    for rid, prompt in ((1, 4), (2, 4)):
        assert model.outputs(rid) == [next_token(rid, prompt + i) for i in range(12)]
    assert scheduler.num_preemptions >= 1
    assert scheduler.allocator.num_free_blocks == 5


def test_a_preempted_request_goes_back_to_the_head_of_the_queue() -> None:
    scheduler, model = make(num_blocks=4, max_num_seqs=2)
    add(scheduler, model, 1, [1, 2, 3, 4], max_new=8)
    add(scheduler, model, 2, [5, 6, 7, 8], max_new=8)
    add(scheduler, model, 3, [9], max_new=1)  # waits: max_num_seqs
    while not (output := step(scheduler, model)).preempted_ids:
        assert scheduler.num_waiting == 1
    assert output.preempted_ids == (2,)
    generated = scheduler.output_token_ids(2)
    assert len(generated) > 0
    admitted = [rid for o in run_until_done(scheduler, model) for rid in o.new_request_ids]
    assert admitted[0] == 2 and admitted[-1] == 3  # (2 may run short of blocks again)
    assert model.outputs(2)[: len(generated)] == list(generated)


# ---- priority ----


def first_tokens(scheduler: Scheduler, model: FakeModel) -> list[int]:
    """Requests in the order they got their first token, until all are done."""
    order: list[int] = []
    for output in run_until_done(scheduler, model):
        order += [
            s.request_id for s in output.scheduled if s.produces_token and s.request_id not in order
        ]
    return order


def test_a_better_priority_preempts_running_ones_and_goes_ahead_of_the_queue() -> None:
    scheduler, model = make(max_num_seqs=2)
    for rid in (1, 2, 3, 4, 5):  # 1 and 2 run; 3, 4, 5 queue
        add(scheduler, model, rid, [rid], max_new=3)
    step(scheduler, model)
    add(scheduler, model, 6, [6], max_new=3, priority=-1)
    add(scheduler, model, 7, [7], max_new=3, priority=-1)
    output = step(scheduler, model)
    # The seats are full: 6 takes the newest one's (2, preempted), then 7 takes 1's.
    assert output.preempted_ids == (2,) and output.new_request_ids == (6,)
    output = step(scheduler, model)
    assert output.preempted_ids == (1,) and output.new_request_ids == (7,)
    order = first_tokens(scheduler, model)
    assert order[:2] == [6, 7] and order[-3:] == [3, 4, 5]  # 1 and 2 resume before 3-5
    assert scheduler.num_priority_preemptions == 2
    for rid in range(1, 8):  # recomputed, the preempted ones' tokens are what they were
        assert model.outputs(rid) == [next_token(rid, p) for p in range(1, 4)]


def test_preemption_for_a_better_priority_frees_blocks_and_spares_its_own_class() -> None:
    scheduler, model = make(num_blocks=8, max_num_seqs=8)  # blocks of 4 tokens
    add(scheduler, model, 1, [1, 2, 3, 4], max_new=4)
    add(scheduler, model, 2, [5, 6, 7, 8], max_new=4, priority=-1)
    add(scheduler, model, 3, [9, 10, 11, 12], max_new=4)
    step(scheduler, model)
    step(scheduler, model)  # each holds 2 blocks: 2 are free
    # 12 tokens need 3 blocks: seats are free, blocks are not. The newest of the worst
    # priority (3) goes; that frees enough, so 1 stays, and 2 (as good as 4) is spared.
    add(scheduler, model, 4, list(range(20, 32)), max_new=2, priority=-1)
    output = step(scheduler, model)
    assert output.preempted_ids == (3,) and output.new_request_ids == (4,)
    run_until_done(scheduler, model)
    for rid in (1, 2, 3):
        assert model.outputs(rid) == [next_token(rid, p) for p in range(4, 8)]
    assert scheduler.num_priority_preemptions == 1


def test_an_equal_or_worse_priority_never_preempts() -> None:
    scheduler, model = make(max_num_seqs=2)
    add(scheduler, model, 1, [1], max_new=4, priority=1)
    add(scheduler, model, 2, [2], max_new=4, priority=1)
    step(scheduler, model)
    add(scheduler, model, 3, [3], max_new=2, priority=1)
    add(scheduler, model, 4, [4], max_new=2, priority=5)
    assert first_tokens(scheduler, model) == [1, 2, 3, 4]
    assert scheduler.num_preemptions == 0


def test_equal_priorities_stay_first_come_first_served() -> None:
    scheduler, model = make(max_num_seqs=1)
    for rid, priority in ((1, 0), (2, 5), (3, 2), (4, 5), (5, 2), (6, 0)):
        add(scheduler, model, rid, [rid], max_new=2, priority=priority)
    assert first_tokens(scheduler, model) == [1, 6, 3, 5, 2, 4]


def test_the_head_of_the_queue_is_not_overtaken_within_a_priority() -> None:
    scheduler, model = make(num_blocks=4)
    add(scheduler, model, 1, list(range(8)), max_new=2)  # 2 blocks
    add(scheduler, model, 2, list(range(50, 62)), max_new=2, priority=1)  # 3 blocks: waits
    add(scheduler, model, 3, [1], max_new=2, priority=1)  # fits, but 2 is ahead
    add(scheduler, model, 4, [2], max_new=2, priority=2)
    assert step(scheduler, model).new_request_ids == (1,)
    assert step(scheduler, model).new_request_ids == ()
    assert step(scheduler, model).new_request_ids == (2, 3)


def test_a_preempted_request_goes_first_within_its_priority_only() -> None:
    scheduler, model = make(num_blocks=4, max_num_seqs=2)
    add(scheduler, model, 1, [1, 2, 3, 4], max_new=8)
    add(scheduler, model, 2, [5, 6, 7, 8], max_new=8)
    add(scheduler, model, 3, [9], max_new=1)  # waits: max_num_seqs
    step(scheduler, model)
    add(scheduler, model, 4, [10], max_new=1, priority=-1)  # better: it preempts 2
    output = step(scheduler, model)
    assert output.preempted_ids == (2,) and output.new_request_ids == (4,)
    # Ahead of 3 (its priority, queued earlier).
    assert [r.request_id for r in scheduler._waiting] == [2, 3]
    admitted = [rid for o in run_until_done(scheduler, model) for rid in o.new_request_ids]
    assert admitted[0] == 2 and admitted[-1] == 3  # (2 may run short of blocks again)


def test_a_copy_still_waits_for_its_originals_prefill_behind_a_better_priority() -> None:
    scheduler, model = make(max_num_batched_tokens=6, max_num_seqs=3)
    prompt = list(range(1, 12))
    add(scheduler, model, 1, prompt)
    add(scheduler, model, 2, prompt, copies=1)
    assert spans(step(scheduler, model)) == {1: (0, 6, False)}
    add(scheduler, model, 3, [30, 31], priority=-1)
    # 3 goes ahead of the copy; the copy still waits for the shared blocks.
    assert spans(step(scheduler, model)) == {1: (6, 11, True), 3: (0, 1, False)}
    assert spans(step(scheduler, model)) == {1: (11, 12, True), 3: (1, 2, True), 2: (8, 11, True)}


# ---- step protocol ----


def test_update_needs_a_scheduled_step() -> None:
    scheduler, model = make()
    with pytest.raises(RuntimeError, match="without a scheduled step"):
        scheduler.update(ModelStepResult())
    assert scheduler.schedule().scheduled == ()
    assert scheduler.schedule().scheduled == ()  # an empty step needs no update
    add(scheduler, model, 1, [1])
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        scheduler.schedule()


def test_update_rejects_results_that_do_not_match_the_step() -> None:
    scheduler, model = make(max_num_batched_tokens=8)
    add(scheduler, model, 1, [1, 2, 3])
    add(scheduler, model, 2, list(range(20)))
    output = scheduler.schedule()  # 1 samples, 2 runs a chunk only
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update(ModelStepResult({}))
    with pytest.raises(ValueError, match="sampled nothing"):
        scheduler.update(ModelStepResult({1: [5], 2: [6]}))
    with pytest.raises(ValueError, match="sampled nothing"):
        scheduler.update(ModelStepResult({1: [5]}, finished_ids=frozenset({2})))
    # A rejected result changes nothing: the step can still be completed.
    scheduler.update(model.run(output))
    scheduler.check_invariants()
    assert scheduler.output_token_ids(1) == (next_token(1, 3),)
