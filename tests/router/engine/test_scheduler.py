"""Scheduler: admission, chunked prefill, decode growth, prefix hits, abort, preemption,
budget adaptation, and random driving by a fake model that checks the KV cache it is given."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from textgate.router.engine.scheduler import (
    BudgetPolicy,
    ModelStepResult,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

VOCAB = 50


def next_token(request_id: int, position: int) -> int:
    """The fake model's deterministic choice for the token at `position`."""
    return (request_id * 31 + position * 7) % VOCAB


@dataclass
class FakeModel:
    """Plays the shards: keeps a fake KV cache and checks every step against it.

    A slot holds a key of the whole sequence up to and including its token, standing
    in for KV that depends on everything before it: reading a block that another
    request overwrote, or a prefix hit on the wrong block, fails the check.
    """

    block_size: int
    sequences: dict[int, list[int]] = field(default_factory=dict)
    num_prompt: dict[int, int] = field(default_factory=dict)
    finish_after: dict[int, int] = field(default_factory=dict)
    keys: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, request_id: int, prompt: list[int], finish_after: int = 1_000) -> None:
        self.sequences[request_id] = list(prompt)
        self.num_prompt[request_id] = len(prompt)
        self.finish_after[request_id] = finish_after
        self.keys[request_id] = []

    def outputs(self, request_id: int) -> list[int]:
        return self.sequences[request_id][self.num_prompt[request_id] :]

    def key(self, request_id: int, position: int) -> tuple[int, int]:
        keys, sequence = self.keys[request_id], self.sequences[request_id]
        while len(keys) <= position:
            parent = keys[-1] if keys else (0, 0)
            keys.append((len(keys), hash((parent, sequence[len(keys)]))))
        return keys[position]

    def slot(self, block_table: tuple[int, ...], position: int) -> int:
        size = self.block_size
        return block_table[position // size] * size + position % size

    def run(self, output: SchedulerOutput, latency: float | None = None) -> ModelStepResult:
        sampled: dict[int, list[int]] = {}
        finished: set[int] = set()
        for step in output.scheduled:
            rid, sequence = step.request_id, self.sequences[step.request_id]
            assert step.token_ids == tuple(sequence[step.start_position : step.end_position])
            for position in range(step.start_position):
                assert self.kv[self.slot(step.block_table, position)] == self.key(rid, position)
            for offset, slot in enumerate(step.slot_mapping):
                assert slot == self.slot(step.block_table, step.start_position + offset)
                self.kv[slot] = self.key(rid, step.start_position + offset)
            assert step.produces_token == (step.end_position == len(sequence))
            if step.produces_token:
                sequence.append(next_token(rid, step.end_position))
                sampled[rid] = [sequence[-1]]
                if len(self.outputs(rid)) >= self.finish_after[rid]:
                    finished.add(rid)
        return ModelStepResult(sampled, frozenset(finished), latency)


def make_config(**overrides: Any) -> SchedulerConfig:
    values: dict[str, Any] = {
        "num_blocks": 16,
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "num_reserved_tokens": 0,
    }
    values.update(overrides)
    return SchedulerConfig(**values)


def make(**overrides: Any) -> tuple[Scheduler, FakeModel]:
    config = make_config(**overrides)
    return Scheduler(config), FakeModel(config.block_size)


def add(
    scheduler: Scheduler, model: FakeModel, rid: int, prompt: list[int], max_new: int = 8
) -> None:
    scheduler.add_request(rid, prompt, max_new)
    model.add(rid, prompt)


def step(scheduler: Scheduler, model: FakeModel, latency: float | None = None) -> SchedulerOutput:
    """One engine step, checking the limits every step must respect."""
    output = scheduler.schedule()
    assert output.num_scheduled_tokens <= output.token_budget
    assert len(output.scheduled) <= scheduler.config.max_num_seqs
    scheduler.update(model.run(output, latency))
    scheduler.check_invariants()
    return output


def spans(output: SchedulerOutput) -> dict[int, tuple[int, int, bool]]:
    return {
        s.request_id: (s.start_position, s.end_position, s.produces_token) for s in output.scheduled
    }


# ---- configuration ----


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be at least 1"),
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ({"num_reserved_tokens": -1}, "num_reserved_tokens"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "at least max_num_seqs"),
        ({"target_step_latency_s": 0.0}, "target_step_latency_s"),
        ({"min_num_batched_tokens": 4}, "min_num_batched_tokens"),
        ({"min_num_batched_tokens": 65}, "min_num_batched_tokens"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_config_is_frozen() -> None:
    config, name = make_config(), "num_blocks"
    with pytest.raises(FrozenInstanceError):
        setattr(config, name, 3)


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
    assert admitted == [2, 3]
    assert model.outputs(2)[: len(generated)] == list(generated)


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


# ---- budget policy ----


def test_budget_policy_halves_on_slow_steps_down_to_the_floor() -> None:
    policy = BudgetPolicy(min_budget=100, max_budget=800, target_step_latency_s=0.05)
    assert policy.budget == 800
    assert policy.next_budget(0.08, kv_usage=0.5) == 400
    assert policy.next_budget(0.08, kv_usage=0.5) == 200
    assert policy.next_budget(0.08, kv_usage=0.5) == 100
    assert policy.next_budget(0.08, kv_usage=0.5) == 100


def test_budget_policy_grows_by_an_eighth_of_its_range_when_fast() -> None:
    policy = BudgetPolicy(min_budget=100, max_budget=900, target_step_latency_s=0.05)
    policy.budget = 100
    assert policy.next_budget(0.01, kv_usage=0.5) == 200
    policy.budget = 880
    assert policy.next_budget(0.01, kv_usage=0.5) == 900


def test_budget_policy_holds_while_the_cache_is_nearly_full() -> None:
    policy = BudgetPolicy(min_budget=100, max_budget=900, target_step_latency_s=0.05)
    policy.budget = 300
    assert policy.next_budget(0.01, kv_usage=0.95) == 300
    assert policy.next_budget(0.08, kv_usage=0.95) == 150


def test_budget_policy_ignores_latency_of_steps_without_decodes() -> None:
    policy = BudgetPolicy(min_budget=100, max_budget=900, target_step_latency_s=0.05)
    policy.budget = 300
    assert policy.next_budget(1.0, kv_usage=0.5, has_decodes=False) == 400


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_budget": 0, "max_budget": 8}, "min_budget"),
        ({"min_budget": 9, "max_budget": 8}, "min_budget"),
        ({"target_step_latency_s": 0.0}, "target_step_latency_s"),
        ({"high_kv_usage": 0.0}, "high_kv_usage"),
    ],
)
def test_budget_policy_validates(kwargs: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {"min_budget": 1, "max_budget": 8, "target_step_latency_s": 0.1}
    values.update(kwargs)
    with pytest.raises(ValueError, match=message):
        BudgetPolicy(**values)


def test_scheduler_feeds_step_latency_to_the_budget() -> None:
    scheduler, model = make(
        num_blocks=64, target_step_latency_s=0.05, max_num_seqs=4, max_num_batched_tokens=64
    )
    add(scheduler, model, 1, list(range(40)), max_new=20)
    step(scheduler, model, latency=0.5)  # a prefill-only step: no decode was slowed
    assert scheduler.token_budget == 64
    step(scheduler, model, latency=0.5)
    assert scheduler.token_budget == 32
    step(scheduler, model, latency=None)  # unmeasured steps change nothing
    assert scheduler.token_budget == 32
    add(scheduler, model, 2, list(range(100, 140)), max_new=20)
    output = step(scheduler, model, latency=0.5)
    assert output.token_budget == 32
    assert output.num_scheduled_tokens == 32  # 1 decode + a 31-token chunk
    assert scheduler.token_budget == 16
    step(scheduler, model, latency=0.001)
    assert scheduler.token_budget == 23  # + (64 - 4) // 8


def test_without_a_latency_target_the_budget_is_fixed() -> None:
    scheduler, model = make()
    add(scheduler, model, 1, [1, 2, 3])
    step(scheduler, model, latency=10.0)
    step(scheduler, model, latency=10.0)
    assert scheduler.budget_policy is None
    assert scheduler.token_budget == 64


# ---- random driving ----

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 10], list(range(11, 23))]


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    """Small caches and budgets, where chunking, sharing and preemption are common."""
    budget = draw(st.integers(2, 24))
    return SchedulerConfig(
        num_blocks=draw(st.integers(4, 24)),
        block_size=draw(st.sampled_from([1, 2, 4])),
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(2, min(6, budget))),
        num_reserved_tokens=draw(st.integers(0, 2)),
        enable_prefix_caching=draw(st.booleans()),
        target_step_latency_s=draw(st.sampled_from([None, 0.01])),
    )


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    max_new: int
    finish_after: int


@st.composite
def request_specs(draw: st.DrawFn, capacity: int) -> RequestSpec:
    prefix = draw(st.sampled_from(PREFIXES))
    suffix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
    prompt = ([*prefix, *suffix] or [0])[: capacity - 1]
    longest = min(16, capacity - len(prompt))
    # Long generations half the time: decode growth is what runs the cache dry.
    max_new = draw(st.just(longest) | st.integers(1, longest))
    return RequestSpec(prompt, max_new, draw(st.integers(1, 24)))


class Harness:
    """Drives a scheduler with the fake model and checks every step and every ending."""

    def __init__(self, config: SchedulerConfig):
        self.scheduler = Scheduler(config)
        self.model = FakeModel(config.block_size)
        self.max_new: dict[int, int] = {}
        self.live: set[int] = set()
        self.aborted: set[int] = set()
        self.next_id = 0

    def add(self, spec: RequestSpec) -> None:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.scheduler.add_request(rid, spec.prompt, spec.max_new)
        self.model.add(rid, spec.prompt, spec.finish_after)
        self.max_new[rid] = spec.max_new
        self.live.add(rid)

    def abort(self, rid: int) -> None:
        assert self.scheduler.abort(rid)
        assert not self.scheduler.allocator.has_table(rid)
        self.live.discard(rid)
        self.aborted.add(rid)

    def step(self, latency: float | None = None, abort_index: int | None = None) -> None:
        """One step; `abort_index` aborts that scheduled request while the step is in flight."""
        output = self.scheduler.schedule()
        self.check_output(output)
        if abort_index is not None and output.scheduled:
            self.abort(output.scheduled[abort_index % len(output.scheduled)].request_id)
        self.scheduler.update(self.model.run(output, latency))
        self.scheduler.check_invariants()
        self.collect_finished()

    def check_output(self, output: SchedulerOutput) -> None:
        ids = [s.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids)) <= self.scheduler.config.max_num_seqs
        assert output.num_scheduled_tokens <= output.token_budget
        assert output.token_budget <= self.scheduler.config.max_num_batched_tokens
        assert set(output.new_request_ids) <= set(ids)
        assert not set(output.preempted_ids) & set(ids)

    def collect_finished(self) -> None:
        for rid in [rid for rid in self.live if not self.scheduler.has_request(rid)]:
            self.live.remove(rid)
            expected = min(self.max_new[rid], self.model.finish_after[rid])
            start = self.model.num_prompt[rid]
            assert self.model.outputs(rid) == [next_token(rid, start + i) for i in range(expected)]

    def drain(self) -> None:
        """Run until every request ended; then the whole pool must be free again."""
        for _ in range(5_000):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        assert not self.scheduler.has_unfinished_requests(), "the scheduler stopped making progress"
        assert not self.live
        assert self.scheduler.allocator.num_free_blocks == self.scheduler.config.num_blocks
        assert self.scheduler.allocator.num_used_blocks == 0


@given(config=configs(), data=st.data())
@settings(max_examples=150, deadline=None, database=None)
def test_random_workloads_finish_every_request_with_its_tokens(
    config: SchedulerConfig, data: st.DataObject
) -> None:
    harness = Harness(config)
    capacity = config.max_num_cached_tokens
    arrivals = data.draw(
        st.lists(st.tuples(st.integers(0, 6), request_specs(capacity)), min_size=1, max_size=10)
    )
    for delay, spec in arrivals:
        for _ in range(delay):
            harness.step(latency=0.1 if delay % 2 else 0.001)
        harness.add(spec)
    harness.drain()


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort sequences, aborts in flight included.

    After every rule all invariants hold; at the end every request has finished with
    exactly the tokens the fake model chose, or was aborted, and the pool is whole.
    """

    @initialize(config=configs())
    def setup(self, config: SchedulerConfig) -> None:
        self.harness = Harness(config)

    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data: st.DataObject, count: int) -> None:
        capacity = self.harness.scheduler.config.max_num_cached_tokens
        for _ in range(count):
            self.harness.add(data.draw(request_specs(capacity)))

    @rule(latency=st.sampled_from([None, 0.001, 0.1]), num_steps=st.integers(1, 4))
    def step(self, latency: float | None, num_steps: int) -> None:
        for _ in range(num_steps):
            self.harness.step(latency)

    @precondition(lambda self: self.harness.live)
    @rule(data=st.data(), in_flight=st.booleans())
    def abort(self, data: st.DataObject, in_flight: bool) -> None:
        if in_flight:
            self.harness.step(abort_index=data.draw(st.integers(0, 5), label="abort index"))
        else:
            self.harness.abort(data.draw(st.sampled_from(sorted(self.harness.live))))

    @invariant()
    def consistent(self) -> None:
        self.harness.scheduler.check_invariants()

    def teardown(self) -> None:
        self.harness.drain()


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, database=None
)
TestSchedulerMachine = SchedulerMachine.TestCase
