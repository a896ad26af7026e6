"""Fair shares between tenants: the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024).

Every tenant has a counter of the service it received, weighted by the work a token
costs and divided by the tenant's `weight`. The scheduler admits, within a priority
class, the waiting request of the backlogged tenant (one with requests in the waiting
queue) whose counter is smallest. A tenant that becomes backlogged after being idle has
its counter lifted to the smallest counter among the backlogged tenants (or, with none,
to that of the tenant that left the queue last), so time spent idle banks no credit.
With one tenant the counters never change the order: the queue is first come, first
served.

Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

PROMPT_TOKEN_COST = 1.0
"""w_p: what one prompt token computed adds to its tenant's counter (the paper's 1)."""

OUTPUT_TOKEN_COST = 2.0
"""w_q: what one generated token adds (the paper's 2: a decode step costs more per token
than a prompt token computed in a batch)."""

ANONYMOUS_TENANT = ""
"""The tenant of every request without an API key file."""


class VirtualCounters:
    """Per-tenant virtual token counters and which tenants are backlogged."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._num_waiting: Counter[str] = Counter()
        self._last_left: str | None = None

    def counter(self, tenant: str) -> float:
        """The weighted service `tenant` received (0 for one never seen)."""
        return self._counters.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        """`tenant`'s weight as its last request gave it (1 for one never seen)."""
        return self._weights.get(tenant, 1.0)

    def below_share(self, running: Mapping[str, int]) -> set[str]:
        """The backlogged tenants whose share of the `running` requests (per tenant) is under
        their weight's share among the tenants running or waiting; empty with fewer than
        two such tenants."""
        present = set(running) | set(self._num_waiting)
        if len(present) < 2:
            return set()
        total_weight = sum(self.weight(tenant) for tenant in present)
        num_running = sum(running.values())
        return {
            tenant
            for tenant in self._num_waiting
            if running.get(tenant, 0) / num_running < self.weight(tenant) / total_weight
        }

    def is_backlogged(self, tenant: str) -> bool:
        """Whether `tenant` has requests in the waiting queue."""
        return self._num_waiting[tenant] > 0

    @property
    def num_backlogged(self) -> int:
        """Tenants with requests in the waiting queue."""
        return len(self._num_waiting)

    def backlog(self) -> dict[str, int]:
        """Waiting requests of each backlogged tenant."""
        return dict(self._num_waiting)

    def arrive(self, tenant: str, weight: float) -> None:
        """A new request of `tenant` is about to join the waiting queue (`join`), with its
        weight as its key file says now. An idle tenant's counter is lifted: to the smallest
        backlogged counter, or with none backlogged to the counter of the tenant that left
        the queue last."""
        if weight <= 0:
            raise ValueError(f"tenant `{tenant}`: weight must be > 0, got {weight}")
        self._weights[tenant] = weight
        if not self.is_backlogged(tenant):
            backlogged = [self.counter(t) for t, n in self._num_waiting.items() if n > 0]
            if backlogged:
                floor = min(backlogged)
            elif self._last_left is not None:
                floor = self.counter(self._last_left)
            else:
                floor = 0.0
            self._counters[tenant] = max(self.counter(tenant), floor)

    def join(self, tenant: str) -> None:
        """One more request of `tenant` waits (new, or preempted and requeued)."""
        self._num_waiting[tenant] += 1

    def leave(self, tenant: str) -> None:
        """One request of `tenant` left the waiting queue (admitted, or aborted)."""
        self._num_waiting[tenant] -= 1
        if self._num_waiting[tenant] <= 0:
            del self._num_waiting[tenant]
            self._last_left = tenant

    def charge(self, tenant: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Add one step's service of one of `tenant`'s requests to its counter."""
        cost = num_prompt_tokens * PROMPT_TOKEN_COST + num_output_tokens * OUTPUT_TOKEN_COST
        if cost:
            weight = self._weights.get(tenant, 1.0)
            self._counters[tenant] = self.counter(tenant) + cost / weight
