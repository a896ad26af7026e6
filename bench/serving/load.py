"""How requests are offered to the server: a closed loop or an open (Poisson) loop.

- Closed loop at concurrency C: C clients, each sends its next request as soon as its
  previous one finished — the server always has exactly C requests in flight (until the
  last ones drain). This is `vllm bench serve --max-concurrency C --request-rate inf`.
- Open loop at rate R: requests arrive at Poisson times (exponential gaps of mean 1/R),
  whether or not earlier ones finished, optionally capped at `max_concurrency` in flight.

The duration of a run is the wall time from the first send to the last completion.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from textgate.bench.serving.metrics import RequestOutcome

# Sends the request with this index in the workload.
SendFn = Callable[[int], Awaitable[RequestOutcome]]


@dataclass(frozen=True)
class LoadLevel:
    """One point of a sweep: a closed-loop concurrency or an open-loop request rate."""

    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load level is either a concurrency or a request rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")

    @property
    def label(self) -> str:
        """Short text for tables: `c=8` or `r=2.5/s`."""
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"r={self.request_rate:g}/s"

    @property
    def x_value(self) -> float:
        """The level as a number, for plots."""
        if self.concurrency is not None:
            return float(self.concurrency)
        assert self.request_rate is not None
        return self.request_rate

    def default_num_requests(self) -> int:
        """Enough requests to keep every client busy twice over, and at least 8."""
        return max(8, 2 * self.concurrency) if self.concurrency is not None else 32


def poisson_offsets(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process; the first is at 0."""
    offsets = [0.0]
    for _ in range(num_requests - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets[:num_requests]


async def run_closed_loop(
    num_requests: int, concurrency: int, send: SendFn
) -> tuple[list[RequestOutcome], float]:
    """Send requests 0..n-1 from `concurrency` clients; outcomes in request order."""
    outcomes: list[RequestOutcome | None] = [None] * num_requests
    next_index = iter(range(num_requests))

    async def client() -> None:
        # The shared iterator hands each index to exactly one client (single event loop).
        for index in next_index:
            outcomes[index] = await send(index)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, num_requests))))
    return _complete(outcomes), time.perf_counter() - start


async def run_open_loop(
    num_requests: int,
    rate: float,
    send: SendFn,
    rng: random.Random,
    max_concurrency: int | None = None,
) -> tuple[list[RequestOutcome], float]:
    """Send requests 0..n-1 at Poisson arrival times; outcomes in request order."""
    offsets = poisson_offsets(num_requests, rate, rng)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def arrival(index: int) -> RequestOutcome:
        await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
        if limit is None:
            return await send(index)
        async with limit:
            return await send(index)

    outcomes = await asyncio.gather(*(arrival(i) for i in range(num_requests)))
    return list(outcomes), time.perf_counter() - start


async def run_load(
    level: LoadLevel, num_requests: int, send: SendFn, seed: int = 0
) -> tuple[list[RequestOutcome], float]:
    """Offer `num_requests` requests at `level`; returns outcomes and the run's duration."""
    if level.concurrency is not None:
        return await run_closed_loop(num_requests, level.concurrency, send)
    assert level.request_rate is not None
    rng = random.Random(seed)
    return await run_open_loop(num_requests, level.request_rate, send, rng, level.max_concurrency)


def _complete(outcomes: list[RequestOutcome | None]) -> list[RequestOutcome]:
    missing = [i for i, o in enumerate(outcomes) if o is None]
    if missing:
        raise RuntimeError(f"requests {missing} were never sent")
    return [o for o in outcomes if o is not None]
