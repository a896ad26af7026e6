"""Streams over real HTTP to clients that read fast, slowly, not at all, or leave.

The router runs in uvicorn on a free port over a paged fake shard that takes
`STEP_DELAY_S` per step. The server's socket and write buffer are small (a few KB, not
the kernel's megabytes and asyncio's 64 KiB), so a client that reads slowly blocks the
response's sends after a few dozen tokens, as it would on a real network after the
buffers fill. Slow and stuck clients read a plain socket at the test's pace; the
chunks of uvicorn's chunked encoding are the router's writes, one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from textgate.router.config import RouterConfig
from textgate.router.engine.channel import STREAM_BUFFER_OVERFLOW
from textgate.router.http.delivery import CLIENT_DISCONNECTED
from textgate.router.server import build_router
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard, FakeTokenizer, fake_shards

SMALL_BUFFER = 4096
"""The slow reader's SO_RCVBUF: far below a stream's ~60 KB, so the router feels its pace.
Not smaller: a receive window of a few hundred bytes on loopback (MSS 64 KB) can leave
the sending side waiting on TCP's silly-window rules and persist timer for tens of
seconds (a stall seen once in a loaded full run, with a 1 KB buffer)."""
STEP_DELAY_S = 0.01
STREAM_LIMITS: dict[str, Any] = {"max_input_tokens": 32, "max_total_tokens": 1024}


class _SmallWriteBuffer(H11Protocol):
    """uvicorn's HTTP/1.1 with a write buffer of a few KB instead of asyncio's 64 KiB."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=SMALL_BUFFER)


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers (pytest owns the process's signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Served:
    port: int
    shard: FakeShard
    engine: Any

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def metric(self, client: httpx.AsyncClient, name: str) -> float:
        """A sample of /metrics, e.g. `tgi_batch_current_size` or `x{reason="y"}` (0 if absent)."""
        text = (await client.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
async def serve(
    uds_path: str, make_config: Callable[..., RouterConfig]
) -> AsyncIterator[Callable[..., contextlib.AbstractAsyncContextManager[Served]]]:
    @contextlib.asynccontextmanager
    async def start(step_delay_s: float = STEP_DELAY_S, **overrides: Any) -> AsyncIterator[Served]:
        """The router over a paged fake shard taking `step_delay_s` per step; `overrides`
        are RouterConfig fields."""
        async with fake_shards(uds_path) as (shard, *_):
            shard.step_delay_s = step_delay_s
            shards = await ShardedClient.connect(uds_path, timeout_s=5)
            config = make_config(**{**STREAM_LIMITS, **overrides})
            app = await build_router(config, shards, FakeTokenizer())
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
            sock.bind(("127.0.0.1", 0))
            server = _QuietServer(
                uvicorn.Config(
                    app,
                    http=_SmallWriteBuffer,
                    log_config=None,
                    ws="none",
                    lifespan="on",
                    timeout_graceful_shutdown=2,
                )
            )
            task = asyncio.create_task(server.serve(sockets=[sock]))
            try:
                while not server.started:
                    if task.done():
                        task.result()
                    await asyncio.sleep(0.01)
                yield Served(sock.getsockname()[1], shard, app.state.engine)
            finally:
                server.should_exit = True
                await task
                sock.close()
                await shards.close()

    return start


class RawStream:
    """A POST over a plain socket with a small receive buffer, read at the test's pace."""

    def __init__(self, port: int, path: str, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self._request = (
            f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode() + payload
        self._port = port
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        self._sock.setblocking(False)
        self.received = b""

    async def send(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_connect(self._sock, ("127.0.0.1", self._port))
        await loop.sock_sendall(self._sock, self._request)

    async def read(self, num_bytes: int) -> bool:
        """Read up to `num_bytes`; False at the end of the response."""
        data = await asyncio.get_running_loop().sock_recv(self._sock, num_bytes)
        self.received += data
        return bool(data)

    async def read_to_end(self, num_bytes: int = 1 << 16, pause_s: float = 0.0) -> None:
        while await self.read(num_bytes):
            await asyncio.sleep(pause_s)

    def close(self) -> None:
        self._sock.close()

    def writes(self) -> list[bytes]:
        """The body's chunks: each one write of the router."""
        head, _, body = self.received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        chunks = []
        while True:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                return chunks
            chunks.append(body[:size])
            body = body[size + 2 :]

    def events(self) -> list[Any]:
        data = b"".join(self.writes()).decode()
        return [json.loads(e) for e in re.findall(r"^data: (.*)$", data, re.MULTILINE)]


async def fast_stream(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[list[float], list[int]]:
    """Read /generate_stream as fast as possible: each token's arrival time and index."""
    times: list[float] = []
    indexes: list[int] = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic())
                indexes.append(json.loads(line[5:])["index"])
    return times, indexes


def stream_body(num_tokens: int, **parameters: Any) -> dict[str, Any]:
    return {"inputs": "w5 w6", "parameters": {"max_new_tokens": num_tokens, **parameters}}


async def run_fast_streams(
    served: Served, num_fast: int, num_tokens: int, slow: RawStream | None
) -> tuple[float, RawStream | None]:
    """`num_fast` fast readers (and `slow`, read at 1 KB per 25 ms) at once: the fast
    ones' inter-token latency p50."""
    limits = httpx.Limits(max_connections=num_fast)
    async with httpx.AsyncClient(base_url=served.url, timeout=30, limits=limits) as client:
        fast = [fast_stream(client, stream_body(num_tokens)) for _ in range(num_fast)]
        slow_task = None
        if slow is not None:
            await slow.send()
            slow_task = asyncio.ensure_future(slow.read_to_end(1024, pause_s=0.025))
        results = await asyncio.gather(*fast)
        if slow_task is not None:
            await asyncio.wait_for(slow_task, 30)
    for _, indexes in results:
        assert indexes == list(range(1, num_tokens + 1))
    gaps = [b - a for times, _ in results for a, b in itertools.pairwise(times)]
    return statistics.median(gaps), slow


async def test_a_slow_reader_gets_every_token_and_does_not_slow_the_fast_ones(
    serve: Callable[..., contextlib.AbstractAsyncContextManager[Served]],
) -> None:
    num_tokens = 30
    alone: list[float] = []
    beside: list[float] = []
    async with serve(max_top_n_tokens=30) as served:
        # Rounds alternate, and the best of each is compared: other load on the machine
        # moves whole rounds, not one kind of round.
        for _ in range(2):
            alone.append((await run_fast_streams(served, 16, num_tokens, None))[0])
            # Alternatives make each event ~2 KB: 30 are far more than the buffers hold, and
            # reading them takes twice as long as generating them.
            body = stream_body(num_tokens, top_n_tokens=30)
            slow = RawStream(served.port, "/generate_stream", body)
            try:
                beside.append((await run_fast_streams(served, 15, num_tokens, slow))[0])
            finally:
                slow.close()
    assert min(beside) <= min(alone) * 1.3, f"fast readers' ITL p50 {beside} vs {alone} alone"
    events = slow.events()
    assert [e["index"] for e in events] == list(range(1, num_tokens + 1))
    assert all(len(e["top_tokens"]) == 30 for e in events)
    writes = slow.writes()
    assert writes[0].count(b"data:") == 1, "the first token is sent alone, at once"
    assert max(w.count(b"data:") for w in writes) > 1, "a slow reader's backlog goes together"


async def test_a_reader_that_stops_is_cancelled_at_the_bound_and_sees_why(
    serve: Callable[..., contextlib.AbstractAsyncContextManager[Served]],
) -> None:
    num_tokens = 900
    async with serve(max_stream_buffer=16) as served:
        stuck = RawStream(served.port, "/generate_stream", stream_body(num_tokens, top_n_tokens=5))
        try:
            await stuck.send()
            await stuck.read(1)  # the response started; then nothing is read
            async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
                overflow = f'textgate_request_cancelled{{reason="{STREAM_BUFFER_OVERFLOW}"}}'
                deadline = time.monotonic() + 20
                while served.engine.num_active or served.shard.held_request_ids():
                    assert time.monotonic() < deadline, "the stuck stream is still running"
                    await asyncio.sleep(0.02)
                assert await served.metric(client, overflow) == 1
                await stuck.read_to_end()
                failures = 'tgi_request_failure{err="stream_buffer_overflow"}'
                assert await served.metric(client, failures) == 1, "once it read the error"
                answer = await client.post("/generate", json=stream_body(3))
                assert answer.status_code == 200
                assert answer.json()["generated_text"] == " t7 t8 t9"
        finally:
            stuck.close()
    events = stuck.events()
    *tokens, last = events
    assert last["error_type"] == STREAM_BUFFER_OVERFLOW and "16 tokens" in last["error"]
    assert [e["index"] for e in tokens] == list(range(1, len(tokens) + 1)), "in order, no gap"
    assert 0 < len(tokens) < num_tokens - 100, "cancelled long before its end"


async def test_fifty_clients_leaving_mid_stream_leave_the_engine_idle(
    serve: Callable[..., contextlib.AbstractAsyncContextManager[Served]],
) -> None:
    num_streams = 50
    async with serve() as served:
        limits = httpx.Limits(max_connections=num_streams + 1)
        async with httpx.AsyncClient(base_url=served.url, timeout=30, limits=limits) as client:
            free_when_idle = await served.metric(client, "textgate_kv_cache_blocks_free")
            assert free_when_idle > 0
            streaming: list[bool] = []
            all_streaming, leave = asyncio.Event(), asyncio.Event()

            async def leave_after_three_tokens() -> None:
                body = stream_body(500)
                async with client.stream("POST", "/generate_stream", json=body) as response:
                    # Held, not abandoned: a dropped line iterator closes the connection.
                    lines = response.aiter_lines()
                    seen = 0
                    while seen < 3:
                        seen += (await anext(lines)).startswith("data:")
                    streaming.append(True)
                    if len(streaming) == num_streams:
                        all_streaming.set()
                    await leave.wait()
                # Leaving the block with the body unread closes the connection.

            leaving = asyncio.gather(*(leave_after_three_tokens() for _ in range(num_streams)))
            await asyncio.wait_for(all_streaming.wait(), 20)
            assert served.engine.num_active == num_streams
            leave.set()
            await leaving
            left_at = time.monotonic()
            while served.engine.num_active or served.shard.held_request_ids():
                assert time.monotonic() - left_at < 1.0, "requests still running after 1 s"
                await asyncio.sleep(0.01)
            for gauge in (
                "tgi_batch_current_size",
                "tgi_queue_size",
                "tgi_batch_current_max_tokens",
            ):
                assert await served.metric(client, gauge) == 0, gauge
            assert await served.metric(client, "textgate_kv_cache_blocks_used") == 0
            assert await served.metric(client, "textgate_kv_cache_blocks_free") == free_when_idle
            cancelled = f'textgate_request_cancelled{{reason="{CLIENT_DISCONNECTED}"}}'
            assert await served.metric(client, cancelled) == num_streams


async def test_the_stream_interval_paces_both_apis(
    serve: Callable[..., contextlib.AbstractAsyncContextManager[Served]],
) -> None:
    completion = {"prompt": "w5 w6", "max_tokens": 9, "stream": True}
    async with serve(stream_interval=4) as served:
        tgi = RawStream(served.port, "/generate_stream", stream_body(9))
        openai = RawStream(served.port, "/v1/completions", completion)
        try:
            for stream in (tgi, openai):
                await stream.send()
                await stream.read_to_end()
        finally:
            tgi.close()
            openai.close()
    assert [w.count(b"data:") for w in tgi.writes()] == [1, 4, 4], "one event per token"
    assert [e["index"] for e in tgi.events()] == list(range(1, 10))
    chunks = [json.loads(w.removeprefix(b"data: ")) for w in openai.writes()[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [
        " t7",
        " t8 t9 t10 t11",
        " t12 t13 t14 t15",
    ], "one chunk per write"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert openai.writes()[-1] == b"data: [DONE]\n\n"
