"""Fair admission between tenants (the Virtual Token Counter): shares while both are
backlogged, a light tenant admitted soon behind a heavy backlog, no burst for a tenant
back from idle, and exactly the old FIFO order with one tenant or none."""

from __future__ import annotations

import pytest

from textgate.router.engine.fairness import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST
from textgate.router.engine.scheduler import Scheduler
from textgate.router.engine.step_types import SchedulerOutput
from textgate.tests.router.engine.scheduler_helpers import FakeModel, add, make, step


def prompt(rid: int, length: int) -> list[int]:
    """A prompt no other request shares (no prefix-cache hits between requests)."""
    return [rid * 100 + i for i in range(length)]


class Meter:
    """Weighted service per tenant, counted from the steps themselves (prompt tokens
    computed × w_p + tokens generated × w_q), not from the scheduler's counters."""

    def __init__(self, tenants: dict[int, str]) -> None:
        self.tenants = tenants
        self.num_prompt: dict[int, int] = {}
        self.served: dict[str, float] = {}

    def record(self, output: SchedulerOutput) -> None:
        for s in output.scheduled:
            prompt_end = min(s.end_position, self.num_prompt[s.request_id])
            cost = max(0, prompt_end - s.start_position) * PROMPT_TOKEN_COST
            cost += OUTPUT_TOKEN_COST if s.produces_token else 0.0
            tenant = self.tenants[s.request_id]
            self.served[tenant] = self.served.get(tenant, 0.0) + cost


def queue(
    scheduler: Scheduler,
    model: FakeModel,
    meter: Meter,
    rids: range,
    tenant: str,
    weight: float = 1.0,
    prompt_len: int = 4,
    max_new: int = 8,
) -> None:
    for rid in rids:
        add(scheduler, model, rid, prompt(rid, prompt_len), max_new, tenant=tenant, weight=weight)
        meter.tenants[rid] = tenant
        meter.num_prompt[rid] = prompt_len


def backlogged(scheduler: Scheduler, tenant: str) -> bool:
    return scheduler.fairness.is_backlogged(tenant)


@pytest.mark.parametrize(("heavy_weight", "light_weight"), [(1.0, 1.0), (2.0, 1.0), (1.0, 2.0)])
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(
    heavy_weight: float, light_weight: float
) -> None:
    scheduler, model = make(max_num_seqs=2)
    meter = Meter({})
    # The heavy tenant queues 10x the requests, all before the light one's.
    queue(scheduler, model, meter, range(200), "heavy", heavy_weight, prompt_len=8, max_new=4)
    queue(scheduler, model, meter, range(200, 220), "light", light_weight)
    while backlogged(scheduler, "light") and backlogged(scheduler, "heavy"):
        meter.record(step(scheduler, model))
    ratio = meter.served["heavy"] / meter.served["light"]
    expected = heavy_weight / light_weight
    assert expected * 0.8 <= ratio <= expected * 1.2, meter.served


def test_a_light_tenant_is_admitted_soon_behind_a_heavy_backlog() -> None:
    scheduler, model = make(max_num_seqs=2)
    meter = Meter({})
    queue(scheduler, model, meter, range(50), "heavy")
    for _ in range(10):
        step(scheduler, model)
    queue(scheduler, model, meter, range(100, 101), "light")
    # FIFO would admit it after the 48 heavy requests still waiting (~190 steps). The two
    # running requests free their slots together every 8 steps: the first admission after
    # it arrived is its.
    num_steps, admitted = 0, ()
    while not admitted and num_steps < 8:
        admitted = step(scheduler, model).new_request_ids
        num_steps += 1
    assert admitted and admitted[0] == 100, (num_steps, admitted)
    assert num_steps == 7


def test_a_tenant_back_from_idle_gets_no_burst_beyond_its_share() -> None:
    scheduler, model = make(max_num_seqs=2)
    meter = Meter({})
    queue(scheduler, model, meter, range(10), "returning")
    queue(scheduler, model, meter, range(100, 400), "steady")
    # "returning" is served its 10 requests, then stays idle while "steady" runs alone.
    while scheduler.num_waiting > 250:
        step(scheduler, model)
    assert not backlogged(scheduler, "returning")
    assert scheduler.fairness.counter("steady") > 3 * scheduler.fairness.counter("returning")
    queue(scheduler, model, meter, range(10, 40), "returning")
    # Lifted to steady's counter, it shares; without the lift its idle time would be
    # credit, and every slot would be its until it caught up.
    for _ in range(60):
        meter.record(step(scheduler, model))
    share = meter.served["returning"] / sum(meter.served.values())
    assert 0.4 <= share <= 0.6, meter.served


def test_a_tenant_arriving_at_an_empty_queue_starts_from_the_last_one_to_leave() -> None:
    scheduler, model = make(max_num_seqs=8)
    meter = Meter({})
    queue(scheduler, model, meter, range(4), "first")
    for _ in range(5):
        step(scheduler, model)
    assert scheduler.num_waiting == 0
    queue(scheduler, model, meter, range(10, 11), "second")
    assert scheduler.fairness.counter("first") > 0
    assert scheduler.fairness.counter("second") == scheduler.fairness.counter("first")


def admission_trace(tenant: str, weight: float) -> list[tuple[object, ...]]:
    """Every step of a tight-KV run (preemptions, priorities, a copy) with all requests
    of `tenant`."""
    scheduler, model = make(num_blocks=8, max_num_seqs=3, max_num_batched_tokens=16)
    trace: list[tuple[object, ...]] = []
    for rid in range(12):
        priority = 1 if rid % 4 == 3 else 0
        copies = 4 if rid == 5 else None
        tokens = prompt(4, 6) if rid == 5 else prompt(rid, 5 + rid % 4)
        add(scheduler, model, rid, tokens, 6, copies, priority, tenant, weight)
    while scheduler.has_unfinished_requests():
        output = step(scheduler, model)
        trace.append((output.new_request_ids, output.preempted_ids, output.finished_ids))
    return trace


def test_one_tenant_or_none_is_served_exactly_in_queue_order() -> None:
    anonymous = admission_trace("", 1.0)
    assert admission_trace("solo", 3.0) == anonymous
    assert any(preempted for _, preempted, _ in anonymous)
    admitted = [rid for new, _, _ in anonymous for rid in new]
    first_admissions = sorted(set(admitted), key=admitted.index)
    # Priority 0 in arrival order (the copy 5 right behind its original 4), then priority 1.
    assert first_admissions == [0, 1, 2, 4, 5, 6, 8, 9, 10, 3, 7, 11]


# ---- a step of its own for a tenant below its share of the running batch ----


def timed_step(scheduler: Scheduler, model: FakeModel) -> SchedulerOutput:
    """A step whose latency a linear cost gives (10 ms + 2 ms a decode + 0.5 ms a prompt
    token), so the controller's fit is ready and its target holds."""
    output = scheduler.schedule()
    assert output.num_scheduled_tokens <= output.token_budget
    decodes = sum(1 for s in output.scheduled if s.num_new_tokens == 1 and s.produces_token)
    prompt_tokens = output.num_scheduled_tokens - decodes
    scheduler.update(model.run(output, 0.010 + 0.002 * decodes + 0.0005 * prompt_tokens))
    scheduler.check_invariants()
    return output


def adaptive(**overrides: object) -> tuple[Scheduler, FakeModel]:
    values: dict[str, object] = {
        "num_blocks": 1024,
        "block_size": 16,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 32,
        "adaptive": True,
        "target_itl_s": 0.1,
        "min_batch_size": 32,
    }
    return make(**(values | overrides))


def decoding_heavy(tenant: str = "heavy") -> tuple[Scheduler, FakeModel, Meter]:
    """20 requests of `tenant` decoding (long outputs), the fit warmed up."""
    scheduler, model = adaptive()
    meter = Meter({})
    queue(scheduler, model, meter, range(20), tenant, prompt_len=12, max_new=500)
    for _ in range(10):
        timed_step(scheduler, model)
    assert scheduler.num_running == 20 and scheduler.controller.step_of_its_own() > 0
    return scheduler, model, meter


def has_decodes(output: SchedulerOutput) -> bool:
    return any(s.request_id < 20 for s in output.scheduled)


def test_a_tenant_below_its_share_gets_its_prompt_a_step_before_the_decodes() -> None:
    scheduler, model, meter = decoding_heavy()
    queue(scheduler, model, meter, range(100, 102), "light", prompt_len=40, max_new=4)
    own = timed_step(scheduler, model)
    # Both light prompts, whole, and nothing of the heavy tenant's.
    assert {s.request_id for s in own.scheduled} == {100, 101}
    assert all(s.produces_token for s in own.scheduled)
    # Never two such steps in a row: a light prompt arriving now joins the decodes' step.
    queue(scheduler, model, meter, range(102, 103), "light", prompt_len=40, max_new=4)
    after = timed_step(scheduler, model)
    assert has_decodes(after) and 102 in {s.request_id for s in after.scheduled}
    # The heavy tenant's own new prompts share the decodes' step as before.
    queue(scheduler, model, meter, range(20, 21), "heavy", prompt_len=40, max_new=4)
    for _ in range(3):
        output = timed_step(scheduler, model)
        assert has_decodes(output) or 20 not in {s.request_id for s in output.scheduled}


def test_one_tenant_never_gets_a_step_without_its_decodes() -> None:
    scheduler, model, meter = decoding_heavy(tenant="")
    for rid in range(100, 110):
        queue(scheduler, model, meter, range(rid, rid + 1), "", prompt_len=40, max_new=4)
        assert has_decodes(timed_step(scheduler, model))


def test_a_prompt_longer_than_the_step_of_its_own_is_chunked_within_it() -> None:
    scheduler, model, meter = decoding_heavy()
    budget = scheduler.controller.step_of_its_own()  # (0.1 - 0.01) / 0.0005 = 180 tokens
    queue(scheduler, model, meter, range(100, 101), "light", prompt_len=budget + 50, max_new=4)
    own = timed_step(scheduler, model)
    assert [(s.request_id, s.num_new_tokens) for s in own.scheduled] == [(100, budget)]
    rest = timed_step(scheduler, model)
    assert has_decodes(rest) and 100 in {s.request_id for s in rest.scheduled}


def test_a_step_of_its_own_never_goes_before_a_better_priority() -> None:
    scheduler, model, meter = decoding_heavy()
    add(scheduler, model, 20, prompt(20, 40), 4, priority=-1, tenant="heavy")
    meter.tenants[20], meter.num_prompt[20] = "heavy", 40
    queue(scheduler, model, meter, range(100, 101), "light", prompt_len=40, max_new=4)
    output = timed_step(scheduler, model)
    assert has_decodes(output) and 20 in {s.request_id for s in output.scheduled}
