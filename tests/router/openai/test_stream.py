"""OpenAI SSE streams from channels, without a server: ordering, joined steps, errors, usage,
cancellation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.generation.stop_text import TextOptions
from textgate.router.openai.output import ResponseMeta
from textgate.router.openai.stream import (
    DONE_FRAME,
    ChatChunks,
    CompletionChunks,
    openai_frames,
)

META = ResponseMeta(id="chatcmpl-1", created=1, model="m")


def step(text: str, finished: str | None = None) -> StepEvent:
    done = None if finished is None else Finished(text, 1, finished, None)  # type: ignore[arg-type]
    return StepEvent(tokens=[TokenInfo(id=1, text=text, logprob=-0.5)], finished=done)


def payloads(writes: list[bytes]) -> list[Any]:
    """The events of every write, in order."""
    out: list[Any] = []
    for frame in [f for w in writes for f in w.split(b"\n\n")[:-1]]:
        data = frame.decode().removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def drain(frames: Any) -> list[bytes]:
    return [frame async for frame in frames]


async def test_chat_frames_one_per_step_for_a_prompt_reader_with_usage() -> None:
    channel = Channel(3)
    writer = ChatChunks(META, 1, TextOptions(), logprobs=False)
    frames = openai_frames([channel], writer, 3, include_usage=True)
    writes = [await anext(frames)]  # the role chunk
    channel.push(step("Hel"))
    writes.append(await anext(frames))
    channel.push(step("lo", "eos_token"))
    writes += await drain(frames)
    events = payloads(writes)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"]["content"] for e in events[:3]] == ["", "Hel", "lo"]
    assert events[2]["choices"][0]["finish_reason"] == "stop"
    assert events[3]["choices"] == []
    assert events[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


async def test_steps_waiting_for_a_slow_reader_go_out_as_one_chunk() -> None:
    channel = Channel(3)
    for text in ("a", "b", "c"):
        channel.push(StepEvent([TokenInfo(id=1, text=text, logprob=-0.5)]))
    channel.push(step("d", "length"))
    writer = ChatChunks(META, 1, TextOptions(), logprobs=True)
    writes = await drain(openai_frames([channel], writer, 3, include_usage=True))
    events = payloads(writes)
    (choice,) = events[1]["choices"]
    assert choice["delta"]["content"] == "abcd"
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["a", "b", "c", "d"]
    assert choice["finish_reason"] == "length"
    assert events[2]["usage"]["completion_tokens"] == 1, "the shard's count, not the chunks'"
    assert len(writes) == 3, "role chunk, then every waiting step in one write, then the end"


async def test_an_error_ends_the_stream_and_cancels_the_other_choices() -> None:
    failing, other = Channel(1), Channel(1)
    other.push(step("a"))
    failing.push(ErrorEvent("boom", "generation"))
    writer = ChatChunks(META, 2, TextOptions(), logprobs=False)
    frames = await drain(openai_frames([failing, other], writer, 1, include_usage=True))
    events = payloads(frames)
    assert events[-2] == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None},
        "error_type": "generation",
    }
    assert frames[-1].endswith(DONE_FRAME)
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
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["P", " a b"]
    assert events[1]["choices"][0]["logprobs"]["text_offset"] == [1, 3]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert {e["object"] for e in events[:-1]} == {"text_completion"}


async def test_a_choice_past_the_buffer_bound_ends_the_stream_with_openais_error() -> None:
    channel = Channel(1)
    channel.bound(2)
    writer = ChatChunks(META, 1, TextOptions(), logprobs=False)
    frames = openai_frames([channel], writer, 1, include_usage=True)
    await anext(frames)  # the role chunk
    for text in ("a", "b", "c"):  # nobody reads meanwhile
        channel.push(StepEvent([TokenInfo(id=1, text=text, logprob=-0.5)]))
    events = payloads(await drain(frames))
    assert events[-1] == "[DONE]"
    assert events[-2]["error_type"] == "stream_buffer_overflow"
    assert "more than 2 tokens unread" in events[-2]["error"]["message"]
    assert len(events) == 2, "the unread tokens are dropped, no usage chunk"
