"""Disconnect storms: clients vanish before their first token, mid-stream, and during the
(chunked) prefill of a long prompt. Batch slots and KV blocks return to idle within a
second; after DISCONNECTS of them (1,000 by default) the free-block count is exactly back
to its start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from textgate.router.http.delivery import CLIENT_DISCONNECTED
from textgate.tests.router.reliability.conftest import ThreadedRouter

DISCONNECTS = int(os.environ.get("DISCONNECTS", "1000"))
WAVE = 25
STEP_DELAY_S = 0.01
LONG_PROMPT = " ".join(f"w{i}" for i in range(10, 70))  # 60 tokens: chunked over 4 steps


async def gauge(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


async def leave(client: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
    """One client that leaves: `before_first_token`, `mid_stream` or `during_prefill`."""
    if kind == "mid_stream":
        body = {"inputs": "w5", "parameters": {"max_new_tokens": 60}}
        async with client.stream("POST", "/generate_stream", json=body) as response:
            lines = response.aiter_lines()
            seen, wanted = 0, rng.randint(1, 5)
            while seen < wanted:
                seen += (await anext(lines)).startswith("data:")
        return
    prompt = LONG_PROMPT if kind == "during_prefill" else "w5"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 60}}
    # Admitted, then gone within the first step (short prompt: before its first token) or
    # within the 4 prefill chunks of the long one (/generate answers only at the end).
    low, high = (2.0, 6.0) if kind == "during_prefill" else (0.5, 1.5)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(
            client.post("/generate", json=body), rng.uniform(low, high) * STEP_DELAY_S
        )


async def wait_idle(client: httpx.AsyncClient, router: ThreadedRouter) -> float:
    """Seconds until no request is admitted, held by the shard, batched or holding blocks."""
    started = time.monotonic()
    while (
        router.engine.num_active
        or router.shard.held_request_ids()
        or await gauge(client, "textgate_kv_cache_blocks_used")
        or await gauge(client, "tgi_batch_current_size")
    ):
        assert time.monotonic() - started < 1.0, "not idle 1 s after the clients left"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_a_thousand_disconnects_leave_the_blocks_exactly_free(
    serve_in_thread: Callable[..., Any],
) -> None:
    rng = random.Random(0)
    kinds = ("before_first_token", "mid_stream", "during_prefill")
    with serve_in_thread(
        step_delay_s=STEP_DELAY_S, max_batch_prefill_tokens=16, max_input_tokens=64
    ) as router:
        limits = httpx.Limits(max_connections=WAVE + 2)
        async with httpx.AsyncClient(base_url=router.url, timeout=30, limits=limits) as client:
            free_at_start = await gauge(client, "textgate_kv_cache_blocks_free")
            slowest = 0.0
            for first in range(0, DISCONNECTS, WAVE):
                wave = min(WAVE, DISCONNECTS - first)
                await asyncio.gather(*(leave(client, rng.choice(kinds), rng) for _ in range(wave)))
                slowest = max(slowest, await wait_idle(client, router))
                assert await gauge(client, "textgate_kv_cache_blocks_free") == free_at_start
            assert await gauge(client, "tgi_queue_size") == 0
            # Every mid-stream client, and those of the others that were admitted before
            # they left, were cancelled in the engine (the rest left before admission).
            cancelled = await gauge(
                client, f'textgate_request_cancelled{{reason="{CLIENT_DISCONNECTED}"}}'
            )
            reached_shard = len(router.shard.received_requests())
            assert cancelled >= DISCONNECTS // 3, cancelled
            print(
                f"{DISCONNECTS} disconnects ({cancelled:.0f} cancelled in the engine, {reached_shard} reached the shard); slowest return to idle {slowest * 1000:.0f} ms"
            )
            # And the server still serves.
            response = await client.post(
                "/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 2}}
            )
            assert response.status_code == 200
