"""The scheduler under its batch controller: step budgets, the join limit, what it reports."""

from __future__ import annotations

from textgate.router.engine.batch_controller import BatchController, StepSample
from textgate.router.engine.scheduler import Scheduler
from textgate.router.engine.step_cost import StepCostModel
from textgate.tests.router.engine.scheduler_helpers import add, make, make_config, step


class RecordingController(BatchController):
    """A controller with a fixed batch limit and prefill share that records what it sees."""

    def __init__(self, limit: int, prefill: int) -> None:
        super().__init__(make_config(adaptive=True).controller_config())
        self._limit, self._prefill = limit, prefill
        self.samples: list[StepSample] = []
        self.num_idle = 0

    def prefill_budget(self, num_decodes: int, context: int = 0, backlog: object = None) -> int:
        return self._prefill

    def observe(self, sample: StepSample) -> None:
        self.samples.append(sample)

    def on_idle(self) -> None:
        self.num_idle += 1
        super().on_idle()


def adaptive(
    limit: int, prefill: int, **overrides: object
) -> tuple[Scheduler, RecordingController]:
    controller = RecordingController(limit, prefill)
    scheduler = Scheduler(make_config(adaptive=True, **overrides), controller)
    return scheduler, controller


def test_budget_is_the_decodes_plus_the_prefill_share() -> None:
    scheduler, _ = adaptive(limit=8, prefill=5, num_blocks=64)
    _, model = make(num_blocks=64)
    for rid in range(3):
        add(scheduler, model, rid, [rid] * 4, max_new=20)
    output = step(scheduler, model, latency=0.01)
    assert output.token_budget == 5  # nothing decodes yet: the share alone
    assert [s.num_new_tokens for s in output.scheduled] == [4, 1]  # the second is a chunk
    output = step(scheduler, model, latency=0.01)
    assert output.token_budget == 1 + 5  # one decode beside the share
    assert output.num_scheduled_tokens == 6


def test_waiting_requests_join_only_below_the_batch_limit() -> None:
    scheduler, _ = adaptive(limit=2, prefill=64, num_blocks=64, max_waiting_steps=1_000)
    _, model = make(num_blocks=64)
    add(scheduler, model, 0, [1, 2], max_new=2)
    for rid in (1, 2):
        add(scheduler, model, rid, [rid, 3], max_new=6)
    step(scheduler, model, latency=0.01)
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    step(scheduler, model, latency=0.01)  # request 0 ends
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    output = step(scheduler, model, latency=0.01)
    assert output.new_request_ids == (2,)


def test_max_waiting_rule_lets_one_request_past_the_limit() -> None:
    scheduler, _ = adaptive(limit=1, prefill=64, num_blocks=64, max_waiting_steps=3)
    _, model = make(num_blocks=64)
    for rid in range(3):
        add(scheduler, model, rid, [rid, 1], max_new=30)
    admitted = [step(scheduler, model, latency=0.01).new_request_ids for _ in range(10)]
    # Request 1 waits 3 steps past the limit, then joins; request 2 waits its own 3.
    assert admitted == [(0,), (), (), (), (1,), (), (), (), (2,), ()]


def test_update_reports_each_step_and_the_queue_after_it() -> None:
    scheduler, controller = adaptive(limit=1, prefill=64, num_blocks=64, max_waiting_steps=1_000)
    _, model = make(num_blocks=64)
    add(scheduler, model, 0, [1, 2, 3], max_new=5)
    add(scheduler, model, 1, [4, 5], max_new=3)
    step(scheduler, model, latency=0.02)
    step(scheduler, model, latency=None)  # unmeasured: nothing reported
    step(scheduler, model, latency=0.01)
    first, second = controller.samples
    assert (first.num_decodes, first.num_prefill_tokens, first.latency_s) == (0, 3, 0.02)
    assert (first.num_running, first.num_waiting) == (1, 1)
    assert (second.num_decodes, second.num_prefill_tokens) == (1, 0)
    assert second.utilization == 0.0 and 0 < second.kv_usage < 1


def test_an_empty_scheduler_tells_the_controller_it_is_idle() -> None:
    scheduler, controller = adaptive(limit=4, prefill=64, num_blocks=64)
    _, model = make(num_blocks=64)
    add(scheduler, model, 0, [1, 2], max_new=1)
    step(scheduler, model, latency=0.01)
    assert controller.num_idle == 0
    scheduler.update(model.run(scheduler.schedule()))
    assert controller.num_idle == 1


def test_fixed_budgets_are_the_maxima() -> None:
    scheduler, model = make(num_blocks=64)
    assert scheduler.token_budget == 64 and scheduler.batch_limit == 8
    for rid in range(10):
        add(scheduler, model, rid, [rid], max_new=4)
    output = step(scheduler, model, latency=5.0)
    assert len(output.scheduled) == 8 and scheduler.token_budget == 64


def test_a_controller_survives_a_rebuilt_scheduler() -> None:
    cost = StepCostModel()
    config = make_config(adaptive=True, target_itl_s=0.05)
    controller = BatchController(config.controller_config(), cost)
    assert Scheduler(config, controller).controller is controller
