"""Scheduler under random workloads: hypothesis drives adds, steps and aborts (in flight
included) against the fake model, which checks every step's tokens and KV cache."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from textgate.router.engine.kv_tiers import KvTierIndex
from textgate.router.engine.scheduler import Scheduler
from textgate.router.engine.step_types import SchedulerConfig, SchedulerOutput
from textgate.tests.router.engine.scheduler_helpers import VOCAB, FakeModel, next_token

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
        adaptive=draw(st.booleans()),
        target_itl_s=draw(st.sampled_from([None, 0.01])),
        min_prefill_tokens=draw(st.integers(1, 8)),
        max_waiting_steps=draw(st.integers(0, 4)),
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

    def __init__(self, config: SchedulerConfig, kv_tiers: KvTierIndex | None = None):
        self.scheduler = Scheduler(config, kv_tiers=kv_tiers)
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


@given(config=configs(), host=st.integers(0, 4), disk=st.booleans(), data=st.data())
@settings(max_examples=100, deadline=None, database=None)
def test_random_workloads_with_kv_tiers_restore_the_kv_of_each_hit(
    config: SchedulerConfig, host: int, disk: bool, data: st.DataObject
) -> None:
    """Evicted prefix blocks go to the host (and disk) tier and come back on hits: the
    fake model, running the plan's transfers in order, checks every restored position."""
    config = replace(config, enable_prefix_caching=True)
    tiers = KvTierIndex(host or (0 if disk else 1), disk=disk)
    harness = Harness(config, tiers)
    capacity = config.max_num_cached_tokens
    arrivals = data.draw(
        st.lists(st.tuples(st.integers(0, 6), request_specs(capacity)), min_size=1, max_size=12)
    )
    for delay, spec in arrivals:
        for _ in range(delay):
            harness.step()
        harness.add(spec)
    harness.drain()
    assert len(harness.model.host) <= tiers.num_host_blocks


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
