"""The sliding window: exact sums over any window, exact waits, settled charges free room."""

from __future__ import annotations

import pytest

from textgate.router.engine.rate_window import SlidingWindow
from textgate.tests.router.fake_clock import FakeClock


def test_charges_leave_the_window_after_window_s() -> None:
    clock = FakeClock()
    window = SlidingWindow(10, 60.0, clock)
    window.charge(6)
    clock.now += 59.9
    assert window.used() == 6
    clock.now += 0.1
    assert window.used() == 0


def test_the_wait_is_until_enough_charges_expire() -> None:
    clock = FakeClock()
    window = SlidingWindow(10, 60.0, clock)
    window.charge(6)
    clock.now += 10
    window.charge(4)
    clock.now += 10
    assert window.wait_s(0) == 0
    # 5 more fit once the 6 charged 20 s ago expire, 40 s from now; not the 4 after them.
    assert window.wait_s(5) == pytest.approx(40.0)
    clock.now += 39.9
    assert window.wait_s(5) == pytest.approx(0.1)
    clock.now += 0.1
    assert window.wait_s(5) == 0
    # 10 need both gone: 10 s more.
    assert window.wait_s(10) == pytest.approx(10.0)


def test_more_than_the_limit_never_fits_and_no_limit_always_does() -> None:
    window = SlidingWindow(10, 60.0, FakeClock())
    assert window.wait_s(11) is None
    unlimited = SlidingWindow(None, 60.0, FakeClock())
    unlimited.charge(10**9)
    assert unlimited.wait_s(10**9) == 0 and unlimited.used() == 0


def test_a_settled_charge_gives_its_rest_back() -> None:
    window = SlidingWindow(100, 60.0, FakeClock())
    charge = window.charge(90)
    assert window.wait_s(20) is not None and window.wait_s(20) > 0
    charge.amount = 15
    assert window.wait_s(20) == 0 and window.used() == 15


@pytest.mark.parametrize("amount", [1, 7])
def test_steady_overload_gets_the_limit_in_every_window(amount: int) -> None:
    """Offered far above the limit for five minutes, every 60 s span holds between 95% and
    100% of it."""
    clock = FakeClock()
    limit = 120
    window = SlidingWindow(limit, 60.0, clock)
    accepted: list[tuple[float, int]] = []
    start = clock.now
    while clock.now < start + 300:
        if window.wait_s(amount) == 0:
            window.charge(amount)
            accepted.append((clock.now, amount))
        clock.now += 0.05
    for begin in range(60, 241, 5):
        t0 = start + begin
        total = sum(a for at, a in accepted if t0 <= at < t0 + 60)
        assert limit * 0.95 <= total <= limit, (begin, total)
