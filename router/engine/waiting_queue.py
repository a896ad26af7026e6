"""The scheduler's waiting queue: requests in admission order, by priority, then fairly by
tenant, first come first served inside a tenant.

Pure Python, as the scheduler is. Requests are ordered by `priority` (lower first); a new
one joins behind every waiting one of its priority or better, a preempted one goes back
ahead of every waiting one of its priority or worse. `next` picks, within the head's
priority, the first request of the backlogged tenant whose weighted service so far is
smallest (`fairness.VirtualCounters`); a preempted head is taken as it is.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from textgate.router.engine.fairness import VirtualCounters


class Waiting(Protocol):
    """What the queue reads of a request."""

    priority: int
    tenant: str
    preempted: bool


W = TypeVar("W", bound=Waiting)


class WaitingQueue(Generic[W]):
    """Waiting requests in admission order; every change tells the tenants' counters who
    is backlogged."""

    def __init__(self, fairness: VirtualCounters) -> None:
        self._fairness = fairness
        self._queue: deque[W] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[W]:
        return iter(self._queue)

    def add(self, request: W) -> None:
        """A new request: behind every waiting one of its priority or better (from the back:
        most requests share one priority, so this is usually an append)."""
        index = len(self._queue)
        while index > 0 and self._queue[index - 1].priority > request.priority:
            index -= 1
        self._queue.insert(index, request)
        self._fairness.join(request.tenant)

    def readd(self, request: W) -> None:
        """A preempted request: ahead of every waiting one of its priority or worse."""
        index = 0
        while index < len(self._queue) and self._queue[index].priority < request.priority:
            index += 1
        self._queue.insert(index, request)
        self._fairness.join(request.tenant)

    def remove(self, request: W) -> None:
        """`request` leaves the queue (admitted or aborted)."""
        self._queue.remove(request)
        self._fairness.leave(request.tenant)

    def next(self, passed_over: Callable[[W], bool] | None = None) -> W | None:
        """The request admission considers next: the head when it was preempted; else, among
        the waiting requests of the head's priority, the first of the tenant with the
        smallest virtual counter (the earliest tenant on a tie). Requests `passed_over`
        says cannot run this step (their LoRA adapter waits for a slot) are left out, the
        first of the others is the head; None when none is left."""
        queue: Iterable[W] = self._queue
        if passed_over is not None:
            queue = (request for request in self._queue if not passed_over(request))
        requests = iter(queue)
        head = next(requests, None)
        if head is None or head.preempted:
            return head
        fairness = self._fairness
        chosen, lowest = head, fairness.counter(head.tenant)
        seen = {head.tenant}
        for request in requests:
            if request.priority != head.priority or len(seen) == fairness.num_backlogged:
                break
            if request.tenant in seen:
                continue
            seen.add(request.tenant)
            counter = fairness.counter(request.tenant)
            if counter < lowest:
                chosen, lowest = request, counter
        return chosen

    def check_invariants(self) -> None:
        """Raise AssertionError if the order or the tenants' backlog is off."""
        tenants = Counter(request.tenant for request in self._queue)
        assert self._fairness.backlog() == dict(tenants), "tenant backlog out of step"
        priorities = [request.priority for request in self._queue]
        assert priorities == sorted(priorities), "the waiting queue is out of priority order"
