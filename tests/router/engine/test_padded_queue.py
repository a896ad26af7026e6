"""Queue budgets and TGI's join rule, without I/O."""

from __future__ import annotations

from dataclasses import dataclass

from textgate.router.engine.padded_queue import BatchLimits, Queue, Running, min_join_size


@dataclass
class Req:
    input_length: int
    max_new_tokens: int
    name: str = ""
    cancelled: bool = False


def limits(**overrides: object) -> BatchLimits:
    values: dict[str, object] = {
        "max_batch_prefill_tokens": 100,
        "max_batch_total_tokens": 1000,
        "max_batch_size": None,
        "waiting_served_ratio": 0.5,
        "max_waiting_tokens": 10,
    }
    values.update(overrides)
    return BatchLimits(**values)


def queue_of(*reqs: Req, **overrides: object) -> Queue[Req]:
    queue: Queue[Req] = Queue(limits(**overrides))
    for req in reqs:
        queue.append(req)
    return queue


def test_empty_queue_admits_nothing() -> None:
    assert queue_of().admit(None) == []


def test_prefill_budget_bounds_the_new_batch() -> None:
    a, b, c = Req(40, 1, "a"), Req(40, 1, "b"), Req(40, 1, "c")
    queue = queue_of(a, b, c)
    assert queue.admit(None) == [a, b]
    assert list(queue) == [c]


def test_total_budget_counts_prompt_and_generation() -> None:
    a, b = Req(10, 500, "a"), Req(10, 500, "b")
    queue = queue_of(a, b)
    assert queue.admit(None) == [a]
    assert list(queue) == [b]


def test_arrival_order_is_kept_when_the_head_does_not_fit() -> None:
    big, small = Req(90, 1, "big"), Req(5, 1, "small")
    queue = queue_of(Req(20, 1), big, small)
    first = queue.admit(None)
    assert len(first) == 1
    assert list(queue) == [big, small]


def test_max_batch_size_caps_the_new_batch() -> None:
    reqs = [Req(1, 1) for _ in range(5)]
    queue = queue_of(*reqs, max_batch_size=3)
    assert queue.admit(None) == reqs[:3]


def test_padded_prefill_costs_size_times_longest_prompt() -> None:
    reqs = [Req(30, 1), Req(10, 1), Req(10, 1), Req(10, 1)]
    # Padded: 3 * 30 = 90 fits, 4 * 30 = 120 does not; unpadded all 60 tokens fit.
    assert len(queue_of(*reqs, requires_padding=True).admit(None)) == 3
    assert len(queue_of(*reqs).admit(None)) == 4


def test_running_batch_leaves_less_total_budget() -> None:
    reqs = [Req(10, 90) for _ in range(5)]
    queue = queue_of(*reqs)
    running = Running(size=1, max_tokens=750, steps_since_prefill=100)
    assert queue.admit(running) == reqs[:2]


def test_few_waiting_do_not_interrupt_a_large_running_batch() -> None:
    running = Running(size=10, max_tokens=100, steps_since_prefill=1)
    queue = queue_of(*[Req(1, 1) for _ in range(4)])
    assert queue.admit(running) == []
    assert len(queue) == 4
    queue.append(Req(1, 1))
    assert len(queue.admit(running)) == 5


def test_waiting_joins_after_max_waiting_tokens_steps() -> None:
    queue = queue_of(Req(1, 1))
    assert queue.admit(Running(size=10, max_tokens=100, steps_since_prefill=9)) == []
    assert len(queue.admit(Running(size=10, max_tokens=100, steps_since_prefill=10))) == 1


def test_min_size_counts_what_fits_not_what_waits() -> None:
    # 5 wait (>= 0.5 * 10) but only 2 fit the token budget: below min_size, nobody joins.
    queue = queue_of(*[Req(10, 90) for _ in range(5)])
    running = Running(size=10, max_tokens=750, steps_since_prefill=1)
    assert queue.admit(running) == []
    assert len(queue) == 5


def test_full_running_batch_admits_nobody() -> None:
    queue = queue_of(Req(1, 1), max_batch_size=4)
    assert queue.admit(Running(size=4, max_tokens=4, steps_since_prefill=100)) == []
    assert len(queue.admit(Running(size=3, max_tokens=3, steps_since_prefill=100))) == 1


def test_min_join_size_follows_the_ratio() -> None:
    lim = limits(waiting_served_ratio=0.3, max_waiting_tokens=20)
    assert min_join_size(Running(10, 0, 0), lim) == 3
    assert min_join_size(Running(1, 0, 0), lim) == 0
    assert min_join_size(Running(10, 0, 20), lim) is None


def test_remove_if_drops_matching_entries() -> None:
    a, b, c = Req(1, 1, "a"), Req(1, 1, "b", cancelled=True), Req(1, 1, "c")
    queue = queue_of(a, b, c)
    assert queue.remove_if(lambda r: r.cancelled) == [b]
    assert list(queue) == [a, c]
