"""Shard faults: a request the model chokes on fails its step cleanly (424, or an error
event) and the next request is served; a hung shard is detected by --shard-step-timeout
and reported, not waited on forever. (A shard killed mid-stream is tested end to end in
tests/e2e.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from textgate.tests.router.reliability.conftest import ThreadedRouter

POISON = "w9 w9 w9"
STEP_TIMEOUT_S = 0.5


async def stream_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        return [
            json.loads(line[5:])
            async for line in response.aiter_lines()
            if line.startswith("data:")
        ]


async def assert_served_and_idle(client: httpx.AsyncClient, router: ThreadedRouter) -> None:
    after = await client.post(
        "/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 3}}
    )
    assert after.status_code == 200, after.text
    assert after.json()["generated_text"] == " t6 t7 t8"
    assert router.engine.num_active == 0


async def test_a_request_the_shard_fails_on_fails_its_step_only(
    serve_in_thread: Callable[..., Any],
) -> None:
    with serve_in_thread(step_delay_s=0.01) as router:
        router.call_soon(lambda: setattr(router.shard, "fail_on_inputs", POISON))
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            # Alone: 424 with TGI's body, again and again (nothing sticks).
            for _ in range(3):
                response = await client.post("/generate", json={"inputs": POISON})
                assert response.status_code == 424, response.text
                assert response.json()["error_type"] == "generation"
                assert "fake failure on 'w9 w9 w9'" in response.json()["error"]
                await assert_served_and_idle(client, router)
            # Beside a running stream: the step they share fails; both end with an error,
            # the stream with an error event as its final one.
            body = {"inputs": "w5", "parameters": {"max_new_tokens": 60}}
            stream = asyncio.create_task(stream_events(client, body))
            await asyncio.sleep(0.1)
            poisoned = await client.post("/generate", json={"inputs": POISON})
            events = await stream
            assert poisoned.status_code == 424
            assert events[-1]["error_type"] == "generation", events[-1]
            assert all("token" in event for event in events[:-1])
            await assert_served_and_idle(client, router)


async def test_a_hung_shard_is_reported_within_the_step_timeout(
    serve_in_thread: Callable[..., Any],
) -> None:
    with serve_in_thread(shard_step_timeout=STEP_TIMEOUT_S) as router:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            router.call_soon(lambda: router.shard.hang.update(Step=1))
            started = time.monotonic()
            response = await client.post("/generate", json={"inputs": "w5"})
            waited = time.monotonic() - started
            assert response.status_code == 424, response.text
            assert response.json() == {
                "error": "Request failed during generation: the shards did not answer a "
                "prefill step within 0.5 s (--shard-step-timeout)",
                "error_type": "generation",
            }
            print(f"hung shard reported after {waited:.3f} s")
            assert STEP_TIMEOUT_S <= waited < STEP_TIMEOUT_S + 2, waited
            await assert_served_and_idle(client, router)
            # Mid-stream: the stream ends with the error event, not silence.
            body = {"inputs": "w5", "parameters": {"max_new_tokens": 20}}
            router.call_soon(lambda: router.shard.hang.update(Step=0))

            async def hang_soon() -> None:
                await asyncio.sleep(0.05)
                router.call_soon(lambda: router.shard.hang.update(Step=1))

            router.call_soon(lambda: setattr(router.shard, "step_delay_s", 0.01))
            hang = asyncio.create_task(hang_soon())
            events = await stream_events(client, body)
            await hang
            assert events[-1]["error_type"] == "generation", events[-1]
            assert "step within 0.5 s" in events[-1]["error"]
            await assert_served_and_idle(client, router)
