from __future__ import annotations

import asyncio
import itertools
import random
import statistics

import pytest

from textgate.bench.serving.load import (
    LoadLevel,
    poisson_offsets,
    run_closed_loop,
    run_load,
    run_open_loop,
)
from textgate.bench.serving.metrics import RequestOutcome


class Probe:
    """A fake `send` that tracks how many requests are in flight at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.sent: list[int] = []

    async def __call__(self, index: int) -> RequestOutcome:
        self.sent.append(index)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.001 * (index % 3))
        self.in_flight -= 1
        return RequestOutcome(success=True, prompt_len=index)


async def test_closed_loop_keeps_exactly_c_in_flight() -> None:
    probe = Probe()
    outcomes, duration = await run_closed_loop(20, 4, probe)
    assert probe.peak == 4
    assert sorted(probe.sent) == list(range(20))
    assert [o.prompt_len for o in outcomes] == list(range(20))  # request order
    assert duration > 0


async def test_closed_loop_with_more_clients_than_requests() -> None:
    probe = Probe()
    outcomes, _ = await run_closed_loop(3, 16, probe)
    assert len(outcomes) == 3
    assert probe.peak <= 3


def test_poisson_offsets_have_mean_gap_one_over_rate() -> None:
    offsets = poisson_offsets(4000, rate=8.0, rng=random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.1)
    assert poisson_offsets(5, 8.0, random.Random(1)) == offsets[:5]  # seeded


async def test_open_loop_sends_everything_and_respects_the_cap() -> None:
    probe = Probe()
    outcomes, _ = await run_open_loop(12, 2000.0, probe, random.Random(0), max_concurrency=2)
    assert [o.prompt_len for o in outcomes] == list(range(12))
    assert probe.peak <= 2


async def test_run_load_dispatches_on_the_level() -> None:
    probe = Probe()
    outcomes, _ = await run_load(LoadLevel(request_rate=5000.0), 5, probe)
    assert len(outcomes) == 5
    outcomes, _ = await run_load(LoadLevel(concurrency=2), 5, probe)
    assert len(outcomes) == 5


def test_load_level_validation_and_labels() -> None:
    with pytest.raises(ValueError):
        LoadLevel()
    with pytest.raises(ValueError):
        LoadLevel(concurrency=2, request_rate=1.0)
    with pytest.raises(ValueError):
        LoadLevel(concurrency=0)
    assert LoadLevel(concurrency=8).label == "c=8"
    assert LoadLevel(request_rate=2.5).label == "r=2.5/s"
    assert LoadLevel(concurrency=1).default_num_requests() == 8
    assert LoadLevel(concurrency=32).default_num_requests() == 64
