"""BusyMeter: utilization as the busy share of recent wall time."""

from __future__ import annotations

import pytest

from textgate.router.engine.busy_meter import BusyMeter


def test_utilization_is_the_busy_share_of_the_window() -> None:
    meter = BusyMeter(window_s=1.0)
    assert meter.utilization(5.0) == 0.0  # nothing recorded
    meter.record(10.0, 10.3)
    meter.record(10.4, 10.8)
    assert meter.utilization(10.8) == pytest.approx(0.7 / 0.8)  # since the first interval
    assert meter.utilization(11.0) == pytest.approx(0.7)
    assert meter.utilization(11.5) == pytest.approx(0.3)  # [10.5, 11.5]: 0.3 of 10.4-10.8
    assert meter.utilization(20.0) == 0.0


def test_back_to_back_steps_are_fully_busy_and_reset_means_idle() -> None:
    meter = BusyMeter(window_s=0.5)
    for k in range(10):
        meter.record(k * 0.1, (k + 1) * 0.1)
    assert meter.utilization(1.0) == pytest.approx(1.0)
    meter.reset()
    assert meter.utilization(1.0) == 0.0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        BusyMeter(window_s=0)
    with pytest.raises(ValueError, match="ends before"):
        BusyMeter().record(2.0, 1.0)
