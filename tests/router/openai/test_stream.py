"""OpenAI SSE streams from channels, without a server: ordering, errors, usage, cancellation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.openai.output import ResponseMeta, TextOptions
from textgate.router.openai.stream import (
    DONE_FRAME,
    ChatChunks,
    CompletionChunks,
    merged,
    openai_frames,
)

META = ResponseMeta(id="chatcmpl-1", created=1, model="m")


def step(text: str, finished: str | None = None) -> StepEvent:
    done = None if finished is None else Finished(text, 1, finished, None)  # type: ignore[arg-type]
    return StepEvent(tokens=[TokenInfo(id=1, text=text, logprob=-0.5)], finished=done)


def payloads(frames: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for frame in frames:
        data = frame.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def drain(frames: Any) -> list[bytes]:
    return [frame async for frame in frames]


async def test_merged_interleaves_channels_until_each_is_final() -> None:
    first, second = Channel(1), Channel(1)
    first.push(step("a"))
    second.push(step("x", "length"))
    first.push(step("b", "length"))
    events = [
        (i, e.tokens[0].text) async for i, e in merged([first, second]) if isinstance(e, StepEvent)
    ]
    assert sorted(events) == [(0, "a"), (0, "b"), (1, "x")]
    assert [t for i, t in events if i == 0] == ["a", "b"]


async def test_chat_frames_with_usage() -> None:
    channel = Channel(3)
    channel.push(step("Hel"))
    channel.push(step("lo", "eos_token"))
    writer = ChatChunks(META, 1, TextOptions(), logprobs=False)
    events = payloads(await drain(openai_frames([channel], writer, 3, include_usage=True)))
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"]["content"] for e in events[:3]] == ["", "Hel", "lo"]
    assert events[2]["choices"][0]["finish_reason"] == "stop"
    assert events[3]["choices"] == []
    assert events[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


async def test_an_error_ends_the_stream_and_cancels_the_other_choices() -> None:
    failing, other = Channel(1), Channel(1)
    other.push(step("a"))
    failing.push(ErrorEvent("boom", "generation"))
    writer = ChatChunks(META, 2, TextOptions(), logprobs=False)
    frames = await drain(openai_frames([failing, other], writer, 1, include_usage=True))
    events = payloads(frames)
    assert events[-2] == {"error": "boom", "error_type": "generation"}
    assert frames[-1] == DONE_FRAME
    assert all(e == "[DONE]" or "error" in e or e["choices"] for e in events), "no usage chunk"
    assert other.cancelled


async def test_closing_the_stream_early_cancels_every_choice() -> None:
    channels = [Channel(1), Channel(1)]
    writer = ChatChunks(META, 2, TextOptions(), logprobs=False)
    frames = openai_frames(channels, writer, 1, include_usage=False)
    assert b'"index":0' in await anext(frames)
    reader = asyncio.ensure_future(drain(frames))
    await asyncio.sleep(0.01)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await frames.aclose()
    assert all(c.cancelled for c in channels)


async def test_completion_frames_echo_and_logprob_offsets() -> None:
    channel = Channel(1)
    channel.push(step(" a"))
    channel.push(step(" b", "length"))
    writer = CompletionChunks(META, ["P"], TextOptions(), echo=True, logprobs=True)
    events = payloads(await drain(openai_frames([channel], writer, 1, include_usage=False)))
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["P", " a", " b"]
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events[1:-1]] == [[1], [3]]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert {e["object"] for e in events[:-1]} == {"text_completion"}
