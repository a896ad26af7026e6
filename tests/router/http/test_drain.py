"""Graceful drain over real HTTP: what a draining router answers, and how it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import uvicorn

from textgate.router.config import RouterConfig
from textgate.router.engine.step_task import SHUTDOWN_MESSAGE
from textgate.router.http.drain import DrainingServer
from textgate.router.server import bound_port, build_router
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard, FakeTokenizer


class _QuietDrainingServer(DrainingServer):
    """Without signal handlers (pytest owns them): the test calls `handle_exit` itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def draining_router(
    sharded: ShardedClient, config: RouterConfig, timeout_s: float
) -> AsyncIterator[tuple[_QuietDrainingServer, asyncio.Task[None], str]]:
    app = await build_router(config, sharded, FakeTokenizer())
    server = _QuietDrainingServer(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on"),
        app.state.drain,
        timeout_s,
        app.state.engine.close,
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield server, task, f"http://127.0.0.1:{bound_port(server, 0)}"
    finally:
        server.should_exit = True
        await task


async def _stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[dict[str, Any]]:
    body = {"inputs": "w5 w6", "parameters": {"max_new_tokens": 30}}
    events = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                started.set()
    return events


async def _start_streams(
    client: httpx.AsyncClient, n: int
) -> list[asyncio.Task[list[dict[str, Any]]]]:
    flags = [asyncio.Event() for _ in range(n)]
    streams = [asyncio.create_task(_stream(client, flag)) for flag in flags]
    await asyncio.wait_for(asyncio.gather(*(flag.wait() for flag in flags)), 10)
    return streams


async def test_sigterm_refuses_new_work_and_lets_streams_finish(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig], fake: FakeShard
) -> None:
    fake.step_delay_s = 0.02
    async with (
        draining_router(sharded, make_config(), timeout_s=30) as (server, task, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        streams = await _start_streams(client, 4)
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0)  # the drain starts on the loop's next turn
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "error": "The server is shutting down",
            "error_type": "shutting_down",
        }
        refused = await client.post("/generate", json={"inputs": "w5"})
        assert refused.status_code == 503 and refused.json()["error_type"] == "shutting_down"
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "w5"}]}
        openai = await client.post("/v1/chat/completions", json=chat)
        assert openai.status_code == 503
        assert openai.json()["error"]["message"] == "The server is shutting down"
        assert (await client.get("/metrics")).status_code == 200
        assert not task.done(), "the streams still run"
        for events in await asyncio.gather(*streams):
            assert len(events) == 30
            assert events[-1]["generated_text"] is not None
        await asyncio.wait_for(task, 10)  # the drain ended the server by itself


async def test_the_drain_timeout_ends_streams_with_a_final_error_event(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig], fake: FakeShard
) -> None:
    fake.step_delay_s = 0.05  # 30 tokens take 1.5 s, well past the timeout
    async with (
        draining_router(sharded, make_config(), timeout_s=0.2) as (server, task, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        streams = await _start_streams(client, 2)
        server.handle_exit(signal.SIGTERM, None)
        for events in await asyncio.gather(*streams):
            assert len(events) < 30
            assert events[-1] == {"error": SHUTDOWN_MESSAGE, "error_type": "generation"}
        await asyncio.wait_for(task, 10)


async def test_an_idle_router_exits_at_once(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig]
) -> None:
    async with draining_router(sharded, make_config(), timeout_s=30) as (server, task, _):
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(task, 2)
    assert server.drain.draining and server.drain.num_active == 0


async def test_a_second_sigint_forces_the_exit(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig], fake: FakeShard
) -> None:
    fake.step_delay_s = 0.05
    async with (
        draining_router(sharded, make_config(), timeout_s=30) as (server, task, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        streams = await _start_streams(client, 1)
        server.handle_exit(signal.SIGINT, None)
        server.handle_exit(signal.SIGINT, None)
        assert server.force_exit
        await asyncio.wait_for(task, 1.0)
        assert not streams[0].done(), "the exit did not wait for the 1.5 s stream"
        streams[0].cancel()
        await asyncio.gather(*streams, return_exceptions=True)
