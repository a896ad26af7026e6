"""BudgetPolicy: the AIMD token budget that adapts to measured step latency."""

from __future__ import annotations

from typing import Any

import pytest

from textgate.router.engine.budget_policy import BudgetPolicy


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
