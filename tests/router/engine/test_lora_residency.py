"""LoRA residency past --max-loras: the policy alone (least recently used idle adapter
evicted, a busy slot never taken, draining, what the shards are told), then through the
scheduler (every running request's adapter resident, requests waiting for a slot never
failed nor starved while the base and resident adapters go past them)."""

from __future__ import annotations

import pytest

from textgate.router.engine.lora_residency import LoraResidency
from textgate.router.engine.scheduler import Scheduler
from textgate.tests.router.engine.scheduler_helpers import FakeModel, make_config, step


def idle() -> set[str]:
    return set()


def test_the_least_recently_used_idle_adapter_makes_room() -> None:
    residency = LoraResidency(2, ["a"])
    assert residency.changes() is None  # the shards hold `a` already
    assert residency.acquire("b", idle) and residency.acquire("a", idle)  # `a` used last
    assert residency.changes() == ("b", "a")
    assert residency.acquire("c", idle)  # `b` is the least recently used
    assert residency.resident == ("a", "c") and residency.changes() == ("a", "c")
    assert residency.acquire("b", lambda: {"a"})  # `c` is idle, `a` is not
    assert residency.resident == ("a", "b")
    assert (residency.num_loads, residency.num_evictions) == (3, 2)
    assert residency.changes() == ("a", "b") and residency.changes() is None


def test_a_busy_slot_is_never_taken_and_the_least_recent_drains() -> None:
    residency = LoraResidency(2, ["a", "b"])
    gate = residency.gate(lambda: {"a", "b"})
    assert gate.admit("a") and gate.admit("")  # resident, and the base
    assert not gate.admit("c")  # every slot busy: it waits
    assert residency.resident == ("b", "a") and residency.draining == "b"
    passed_over = gate.passed_over
    assert passed_over is not None
    assert [passed_over(_On(name)) for name in ("a", "b", "c", "")] == [False, True, True, False]
    assert not gate.admit("b")  # draining: no new request on it
    # Next step, `b` still busy: it still drains; once idle, `c` takes its slot.
    assert not residency.gate(lambda: {"a", "b"}).admit("b")
    gate = residency.gate(lambda: {"a"})
    assert residency.draining is None and gate.passed_over is None
    assert gate.admit("c") and residency.resident == ("a", "c")
    assert residency.num_evictions == 1


def test_the_shards_are_told_again_after_a_failed_step_and_forget_unloads() -> None:
    residency = LoraResidency(2)
    assert residency.changes() is None
    assert residency.acquire("a", idle) and residency.changes() == ("a",)
    residency.resend()
    assert residency.changes() == ("a",)
    residency.forget("a")  # unloaded: the shards detached it themselves
    assert residency.resident == () and residency.changes() is None
    assert residency.acquire("a", idle) and residency.changes() == ("a",)  # loaded again
    residency.forget("a")
    assert residency.acquire("b", idle) and residency.changes() == ("b",)
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        LoraResidency(0)
    with pytest.raises(ValueError, match="2 adapters resident, over max_loras 1"):
        LoraResidency(1, ["a", "b"])


class _On:
    def __init__(self, adapter: str) -> None:
        self.adapter = adapter


# ---- through the scheduler ----


def _prompt(rid: int) -> list[int]:
    return [rid * 100 + i for i in range(5)]


def _lora_scheduler(max_loras: int = 2) -> tuple[Scheduler, FakeModel, LoraResidency]:
    config = make_config(num_blocks=64, max_num_seqs=8)
    scheduler = Scheduler(config)
    scheduler.residency = residency = LoraResidency(max_loras)
    return scheduler, FakeModel(config.block_size), residency


def _add(scheduler: Scheduler, model: FakeModel, rid: int, adapter: str, max_new: int) -> None:
    scheduler.add_request(rid, _prompt(rid), max_new, adapter=adapter)
    model.add(rid, _prompt(rid))


def test_four_adapters_over_two_slots_all_finish_each_only_while_resident() -> None:
    scheduler, model, residency = _lora_scheduler()
    adapters = {rid: "abcd"[rid % 4] for rid in range(12)} | {12: "", 13: ""}
    for rid, adapter in adapters.items():
        _add(scheduler, model, rid, adapter, max_new=3 + rid % 5)
    admitted: dict[int, int] = {}
    sent = []
    for number in range(200):
        if not scheduler.has_unfinished_requests():
            break
        output = step(scheduler, model)  # checks: every running adapter resident
        for rid in output.new_request_ids:
            admitted.setdefault(rid, number)
            assert adapters[rid] == "" or adapters[rid] in residency.resident
        resident = residency.changes()
        if resident is not None:
            sent.append(resident)
    assert not scheduler.has_unfinished_requests()
    for rid, adapter in adapters.items():
        assert len(model.outputs(rid)) == 3 + rid % 5, (rid, adapter)
    assert all(len(resident) <= 2 for resident in sent) and len(sent) > 2
    assert residency.num_evictions >= 2 and residency.num_loads == residency.num_evictions + 2
    # The base requests, behind eight adapter requests, were not held up by the waiting ones.
    assert admitted[12] == admitted[13] == 0


def test_a_request_waiting_for_a_slot_gets_one_while_its_slots_adapter_drains() -> None:
    scheduler, model, residency = _lora_scheduler()
    _add(scheduler, model, 0, "a", max_new=6)
    _add(scheduler, model, 1, "b", max_new=20)
    step(scheduler, model)
    _add(scheduler, model, 2, "c", max_new=2)  # no slot: `a` and `b` are busy
    numbers = {}
    for number in range(1, 40):
        _add(scheduler, model, 100 + number, "ab"[number % 2], max_new=10)  # ever more a, b
        output = step(scheduler, model)
        for rid in output.new_request_ids:
            numbers[rid] = number
        if 2 in numbers:
            break
    # `a`, the least recently used, drained (no new request on it), then `c` took its slot;
    # `b` went on admitting.
    assert numbers[2] == 6 and residency.num_evictions == 1
    assert not [rid for rid, n in numbers.items() if rid > 100 and rid % 2 == 0 and n < 6]
    assert [rid for rid in numbers if rid > 100 and rid % 2 == 1]
    assert "c" in residency.resident and "a" not in residency.resident
