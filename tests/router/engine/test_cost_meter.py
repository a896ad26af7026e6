"""CostMeter: a step's busy time split between input and output tokens by the step cost
model, per tenant, priced over a sliding window."""

from __future__ import annotations

import math

import pytest

from textgate.router.engine.cost_meter import CostMeter, TokenWork, split_step
from textgate.router.engine.step_cost import attention_pairs
from textgate.tests.router.fake_clock import FakeClock

# overhead, per decode, per prefill token, per thousand attention pairs (s)
COEFFICIENTS = (0.010, 0.002, 0.001, 0.0005)


def decode(tenant: str = "", position: int = 50, drafts: int = 0, out: int = 1) -> TokenWork:
    return TokenWork(tenant, position, 1, 0, True, drafts, out)


def chunk(tenant: str = "", start: int = 0, n: int = 100, prompt: int | None = None) -> TokenWork:
    return TokenWork(tenant, start, n, n if prompt is None else prompt, False)


def test_a_step_is_split_by_each_parts_modelled_cost_and_adds_up() -> None:
    works = [decode(), chunk(start=200, n=100)]
    (decode_in, decode_out), (chunk_in, chunk_out) = split_step(0.3, works, COEFFICIENTS)
    decode_weight = 0.002
    chunk_weight = 0.001 * 100 + 0.0005 * attention_pairs(200, 100)
    assert decode_in == 0 and chunk_out == 0
    assert decode_out == pytest.approx(0.3 * decode_weight / (decode_weight + chunk_weight))
    assert chunk_in == pytest.approx(0.3 * chunk_weight / (decode_weight + chunk_weight))
    # The overhead goes along: every busy second is someone's.
    assert decode_out + chunk_in == pytest.approx(0.3)


def test_a_late_chunk_of_a_long_prompt_weighs_more_than_its_first() -> None:
    (early, _), (late, _) = split_step(1.0, [chunk(start=0), chunk(start=3000)], COEFFICIENTS)
    assert late > 2 * early
    assert early + late == pytest.approx(1.0)


def test_verified_drafts_are_output_time() -> None:
    [(plain_in, plain_out)] = split_step(0.1, [decode()], COEFFICIENTS)
    (_, plain), (_, speculated) = split_step(0.2, [decode(), decode(drafts=4)], COEFFICIENTS)
    assert plain_in == 0 and plain_out == pytest.approx(0.1)
    drafts = 0.001 * 4 + 0.0005 * attention_pairs(51, 4)
    assert speculated / plain == pytest.approx((0.002 + drafts) / 0.002)


def test_an_unfitted_model_splits_by_tokens_computed() -> None:
    works = [decode(), chunk(n=9), decode(drafts=2)]
    split = split_step(1.3, works, (0.0, 0.0, 0.0, 0.0))
    assert split == [
        pytest.approx((0.0, 0.1)),
        pytest.approx((0.9, 0.0)),
        pytest.approx((0.0, 0.3)),
    ]
    assert split_step(0.5, [], COEFFICIENTS) == []


def test_costs_are_device_hours_over_tokens_in_the_window() -> None:
    clock = FakeClock()
    meter = CostMeter(device_hour_cost=3.6, window_s=10.0, clock=clock)
    # Zero slopes: the split is by tokens, easy to follow by hand.
    flat = (0.0, 0.0, 0.0, 0.0)
    meter.record(2.0, [chunk("a", n=100), chunk("b", n=100)], flat)  # 1 s of input each
    clock.now += 1
    meter.record(0.5, [decode("a", out=1), decode("", out=1)], flat)  # 0.25 s of output each
    report = meter.report()
    # 3.6 USD per hour is 0.001 USD per second.
    assert report.window.num_input_tokens == 200 and report.window.num_output_tokens == 2
    assert report.window.per_1k_input_tokens_usd == pytest.approx(0.001 * 2.0 / 200 * 1000)
    assert report.window.per_1k_output_tokens_usd == pytest.approx(0.001 * 0.5 / 2 * 1000)
    # Named tenants only; the anonymous request counts in the overall costs.
    assert set(report.tenants) == {"a", "b"}
    a, b = report.tenants["a"], report.tenants["b"]
    assert a.per_1k_input_tokens_usd == pytest.approx(0.001 * 1.0 / 100 * 1000)
    assert a.per_1k_output_tokens_usd == pytest.approx(0.001 * 0.25 * 1000)
    assert b.per_1k_output_tokens_usd is None  # no token generated: no price, not infinity
    # Past the window the first step leaves the live costs, not the lifetime ones.
    clock.now += 9.5
    later = meter.report()
    assert later.window.num_input_tokens == 0 and later.window.per_1k_input_tokens_usd is None
    assert later.window.num_output_tokens == 2
    assert later.lifetime.num_input_tokens == 200
    assert later.lifetime.input_busy_s == pytest.approx(2.0)
    assert set(later.tenants) == {"a"}
    assert later.tenants_lifetime["b"].input_busy_s == pytest.approx(1.0)


def test_prompt_tokens_count_once_and_recompute_costs_input_time() -> None:
    meter = CostMeter(1.0)
    # A recompute after preemption: 20 prompt tokens and 10 generated ones computed again.
    meter.record(1.0, [chunk(n=30, prompt=20)], COEFFICIENTS)
    report = meter.report()
    assert report.window.num_input_tokens == 20
    assert report.window.input_busy_s == pytest.approx(1.0)


def test_bad_inputs_are_refused() -> None:
    for cost in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="device_hour_cost"):
            CostMeter(cost)
    with pytest.raises(ValueError, match="window_s"):
        CostMeter(1.0, window_s=0)
    with pytest.raises(ValueError, match="busy time"):
        split_step(-0.1, [decode()], COEFFICIENTS)
    with pytest.raises(ValueError, match="coefficients"):
        split_step(0.1, [decode()], (1.0, 2.0))
    with pytest.raises(ValueError, match="one generated token"):
        TokenWork("", 5, 2, 0, True)
    with pytest.raises(ValueError, match="more prompt tokens"):
        TokenWork("", 0, 2, 3, False)
