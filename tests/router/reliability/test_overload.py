"""Overload: ten times --max-concurrent-requests at once. The excess gets 429 at once,
every accepted request completes with all its tokens, /health stays responsive."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

MAX_CONCURRENT = 8
NUM_REQUESTS = 10 * MAX_CONCURRENT
MAX_NEW_TOKENS = 50
STEP_DELAY_S = 0.02


async def one_request(client: httpx.AsyncClient, i: int) -> tuple[int, float, int]:
    """(status, seconds to the answer's status line, tokens received)."""
    parameters = {"max_new_tokens": MAX_NEW_TOKENS, "details": True}
    body = {"inputs": f"w{i + 3}", "parameters": parameters}
    started = time.monotonic()
    if i % 2:
        async with client.stream("POST", "/generate_stream", json=body) as response:
            answered = time.monotonic() - started
            if response.status_code != 200:
                await response.aread()
                assert response.json() == {
                    "error": "Model is overloaded",
                    "error_type": "overloaded",
                }
                return response.status_code, answered, 0
            events = [
                json.loads(line[5:])
                async for line in response.aiter_lines()
                if line.startswith("data:")
            ]
            assert all("error" not in event for event in events), events[-1]
            assert events[-1]["details"]["generated_tokens"] == MAX_NEW_TOKENS
            return 200, answered, len(events)
    response = await client.post("/generate", json=body)
    answered = time.monotonic() - started
    if response.status_code != 200:
        assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        return response.status_code, answered, 0
    return 200, answered, response.json()["details"]["generated_tokens"]


async def poll_health(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.monotonic()
        response = await client.get("/health")
        latencies.append(time.monotonic() - started)
        assert response.status_code == 200
        await asyncio.sleep(0.02)
    return latencies


async def test_ten_times_the_limit_at_once(serve_in_thread: Callable[..., Any]) -> None:
    with serve_in_thread(
        step_delay_s=STEP_DELAY_S, max_concurrent_requests=MAX_CONCURRENT, max_total_tokens=256
    ) as router:
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 4)
        async with httpx.AsyncClient(base_url=router.url, timeout=30, limits=limits) as client:
            stop = asyncio.Event()
            health = asyncio.create_task(poll_health(client, stop))
            results = await asyncio.gather(*(one_request(client, i) for i in range(NUM_REQUESTS)))
            stop.set()
            health_latencies = await health
            accepted = [r for r in results if r[0] == 200]
            rejected = [r for r in results if r[0] != 200]
            assert {r[0] for r in rejected} <= {429}
            # All arrive within one generation's time: only the limit's worth is admitted.
            assert MAX_CONCURRENT <= len(accepted) <= 2 * MAX_CONCURRENT, len(accepted)
            # Every accepted request got all its tokens (a stream: one event per token).
            assert all(tokens == MAX_NEW_TOKENS for _, _, tokens in accepted)
            # 429s answer at once: before an accepted request could have finished generating
            # (its MAX_NEW_TOKENS steps, or longer on a machine slowed by other work: the
            # fastest accepted /generate's answer is the bound then, since a 429 that waited
            # for a generation would come after it).
            generation_s = MAX_NEW_TOKENS * STEP_DELAY_S
            finished = [
                seconds
                for i, (status, seconds, _) in enumerate(results)
                if status == 200 and i % 2 == 0
            ]
            bound = max(generation_s, min(finished, default=generation_s))
            slowest = sorted(r[1] for r in rejected)[-3:]
            assert max(slowest) < bound, (slowest, bound)
            print(
                f"{len(accepted)} accepted, {len(rejected)} x 429 (slowest {max(slowest):.3f} s), "
                f"{len(health_latencies)} /health polls (slowest {max(health_latencies):.3f} s)"
            )
            assert len(health_latencies) >= 3
            # The first poll lands amid 80 arrivals on a 2-core CI machine (0.6 s seen once);
            # the rest answer in milliseconds.
            assert max(health_latencies) < 2.0, max(health_latencies)
            assert statistics.median(health_latencies) < 0.25, health_latencies
            # Nothing is left behind, and the next request is served.
            assert router.engine.num_active == 0
            after = await client.post(
                "/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 2}}
            )
            assert after.status_code == 200
