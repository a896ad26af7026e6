"""How many tokens the next step may compute, adapted to measured step latency."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BudgetPolicy:
    """Adapts the per-step token budget to a latency target, AIMD-style.

    A long prefill chunk in a step makes every decode in that step wait for it, so
    decode inter-token latency grows with the budget. After a step that had decodes
    and ran slower than the target, the budget halves (a fast reaction to a latency
    spike); after a step under the target it grows by an eighth of its range (a
    careful probe back up). While the KV cache is nearly full it holds: admission is
    limited by blocks then, and bigger prefills would only bring preemptions sooner.
    A step without decodes hurts no inter-token latency, so it never shrinks the budget.
    """

    min_budget: int
    max_budget: int
    target_step_latency_s: float
    high_kv_usage: float = 0.9
    budget: int = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_budget <= self.max_budget:
            raise ValueError(
                f"need 1 <= min_budget <= max_budget, got {self.min_budget}, {self.max_budget}"
            )
        if self.target_step_latency_s <= 0:
            raise ValueError(f"target_step_latency_s must be > 0, got {self.target_step_latency_s}")
        if not 0.0 < self.high_kv_usage <= 1.0:
            raise ValueError(f"high_kv_usage must be in (0, 1], got {self.high_kv_usage}")
        self.budget = self.max_budget

    def next_budget(self, step_latency_s: float, kv_usage: float, has_decodes: bool = True) -> int:
        """Record one step's latency and KV usage; return the budget for the next step."""
        if has_decodes and step_latency_s > self.target_step_latency_s:
            self.budget = max(self.min_budget, self.budget // 2)
        elif kv_usage < self.high_kv_usage:
            step = max(1, (self.max_budget - self.min_budget) // 8)
            self.budget = min(self.max_budget, self.budget + step)
        return self.budget
