"""SSE framing, immediate flushing and disconnect handling, over a hand-driven ASGI cycle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from textgate.router.http.sse import SseResponse, error_frame, sse_frame
from textgate.router.tgi.schemas import StreamResponse, Token

SCOPE: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.3"}}


def test_a_frame_is_data_json_and_a_blank_line() -> None:
    token = Token(id=1, text=" a", logprob=-0.5, special=False)
    frame = sse_frame(StreamResponse(index=1, token=token))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2, "one event, one data line"
    assert json.loads(frame[len(b"data: ") :]) == {
        "index": 1,
        "token": {"id": 1, "text": " a", "logprob": -0.5, "special": False},
        "generated_text": None,
        "details": None,
    }


def test_newlines_in_text_stay_inside_the_json_string() -> None:
    token = Token(id=1, text="a\n\nb", logprob=None, special=False)
    frame = sse_frame(StreamResponse(index=1, token=token))
    assert frame.count(b"\n") == 2


def test_an_error_frame_has_tgi_error_shape() -> None:
    frame = error_frame("boom", "generation")
    assert frame == b'data: {"error":"boom","error_type":"generation"}\n\n'


class Client:
    """The server side of one ASGI HTTP cycle, driven by the test."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.sent_event = asyncio.Event()
        self.disconnect = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self.sent_event.set()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def test_each_frame_is_sent_as_soon_as_it_exists() -> None:
    client = Client()
    release = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await release.wait()
        yield b"data: 2\n\n"

    response = SseResponse(frames(), on_disconnect=lambda: None, headers={"x-test": "1"})
    task = asyncio.create_task(response(SCOPE, client.receive, client.send))
    while client.bodies() != [b"data: 1\n\n"]:
        await asyncio.wait_for(client.sent_event.wait(), 1)
        client.sent_event.clear()
    start = client.sent[0]
    headers = dict(start["headers"])
    assert start["status"] == 200
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-accel-buffering"] == b"no"
    assert headers[b"x-test"] == b"1"
    release.set()
    await asyncio.wait_for(task, 1)
    assert client.bodies() == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False


async def test_a_disconnect_cancels_even_while_no_frame_is_due() -> None:
    client = Client()
    disconnected = []
    cleaned_up = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()
            yield b"never"
        finally:
            cleaned_up.set()

    response = SseResponse(frames(), on_disconnect=lambda: disconnected.append(True))
    task = asyncio.create_task(response(SCOPE, client.receive, client.send))
    await asyncio.wait_for(client.sent_event.wait(), 1)
    client.disconnect.set()
    await asyncio.wait_for(task, 1)
    assert disconnected == [True]
    assert cleaned_up.is_set()
    assert b"never" not in client.bodies()


async def test_a_quiet_stream_gets_keep_alive_comments_and_loses_no_frame() -> None:
    client = Client()
    release = asyncio.Event()
    interrupted = []

    async def frames() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        try:
            await release.wait()  # longer than several keep-alive periods
        except asyncio.CancelledError:
            interrupted.append(True)
            raise
        yield b"data: 2\n\n"

    response = SseResponse(frames(), on_disconnect=lambda: None, keep_alive_s=0.02)
    task = asyncio.create_task(response(SCOPE, client.receive, client.send))
    while client.bodies().count(b":\n\n") < 3:
        await asyncio.wait_for(client.sent_event.wait(), 1)
        client.sent_event.clear()
    release.set()
    await asyncio.wait_for(task, 1)
    bodies = client.bodies()
    assert bodies[0] == b"data: 1\n\n" and bodies[-2:] == [b"data: 2\n\n", b""]
    assert set(bodies[1:-2]) == {b":\n\n"}
    assert not interrupted, "a keep-alive must not cancel the frame being produced"


async def test_a_busy_stream_sends_no_keep_alive() -> None:
    client = Client()

    async def frames() -> AsyncIterator[bytes]:
        for i in range(5):
            await asyncio.sleep(0.001)
            yield f"data: {i}\n\n".encode()

    response = SseResponse(frames(), on_disconnect=lambda: None, keep_alive_s=1.0)
    await asyncio.wait_for(response(SCOPE, client.receive, client.send), 2)
    assert client.bodies() == [f"data: {i}\n\n".encode() for i in range(5)] + [b""]


async def test_a_failing_frame_generator_raises_its_own_error() -> None:
    client = Client()

    async def frames() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise ValueError("bug in a stream")

    response = SseResponse(frames(), on_disconnect=lambda: None)
    with pytest.raises(Exception) as error:  # out of the response's task group: grouped
        await asyncio.wait_for(response(SCOPE, client.receive, client.send), 1)
    assert error.group_contains(ValueError, match="bug in a stream")
    assert client.bodies() == [b"data: 1\n\n"]
