"""Anthropic streams from a channel, without a server: the events, and that they say
exactly what the non-streamed answer says (thinking, text, call input, stop reason,
usage)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from textgate.router.anthropic.output import message_response
from textgate.router.anthropic.stream import MessageEvents
from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.generation.reasoning import ReasoningParser, reasoning_parser
from textgate.router.generation.result import collect
from textgate.router.generation.stop_text import TextOptions
from textgate.router.generation.tools import NO_TOOL
from textgate.router.http.event_stream import event_stream

CALL = '{"name": "get_weather", "arguments": {"city": "Oslo \\u00e9", "days": [1, 2]}}'


def steps(pieces: list[str], reason: str, text: str | None = None) -> list[StepEvent]:
    """One step per piece; the last finishes with `reason` (its whole text: `text`)."""
    events = [StepEvent(tokens=[TokenInfo(id=1, text=p, logprob=-0.5)]) for p in pieces]
    done = Finished(text if text is not None else "".join(pieces), len(pieces), reason, None)  # type: ignore[arg-type]
    events[-1] = StepEvent(tokens=events[-1].tokens, finished=done)
    return events


def parse(writes: list[bytes]) -> list[tuple[str, Any]]:
    pairs = []
    for frame in b"".join(writes).decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        pairs.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return pairs


def streamed(
    events: list[StepEvent],
    options: TextOptions,
    tools: bool,
    reasoning: ReasoningParser | None = None,
) -> list[tuple[str, Any]]:
    """The writer's events for `events`, one step at a time (as a prompt reader gets them)."""
    writer = MessageEvents("msg_1", "m", 4, options, tools=tools, reasoning=reasoning)
    writes = [writer.opening(), *(writer.step(0, event) for event in events)]
    generated = sum(e.finished.generated_tokens for e in events if e.finished is not None)
    return parse([*writes, writer.closing(None, generated)])


async def answered(
    events: list[StepEvent],
    options: TextOptions,
    tools: bool,
    reasoning: ReasoningParser | None = None,
) -> dict[str, Any]:
    channel = Channel(4)
    for event in events:
        channel.push(event)
    generated = await collect(channel)
    answer = message_response("msg_1", "m", generated, options, tools=tools, reasoning=reasoning)
    return answer.model_dump(mode="json")


def as_answer(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """What a client assembles from the events (as the anthropic SDK does; the input
    is parsed once the call is complete)."""
    message = pairs[0][1]["message"]
    partial = ""
    for name, data in pairs[1:]:
        if name == "content_block_start":
            message["content"].append(data["content_block"])
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            message["content"][data["index"]]["text"] += data["delta"]["text"]
        elif name == "content_block_delta" and data["delta"]["type"] == "thinking_delta":
            message["content"][data["index"]]["thinking"] += data["delta"]["thinking"]
        elif name == "content_block_delta":
            partial += data["delta"]["partial_json"]
        elif name == "content_block_stop" and partial:
            message["content"][data["index"]]["input"] = json.loads(partial)
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"] = data["usage"]
    return message


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    for block in message["content"]:
        block.pop("id", None)
    return message


@pytest.mark.parametrize("seed", range(12))
async def test_a_streamed_call_assembles_to_the_answer(seed: int) -> None:
    pieces = splits(CALL, random.Random(seed))
    streamed_pairs = streamed(steps(pieces, "eos_token"), TextOptions(), tools=True)
    names = [name for name, _ in streamed_pairs]
    assert names[:2] == ["message_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    (start,) = [data for name, data in streamed_pairs if name == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["id"].startswith(
        "toolu_"
    )
    # The raw input text, joined, is the call's arguments as generated.
    partial = "".join(
        d["delta"]["partial_json"] for n, d in streamed_pairs if n == "content_block_delta"
    )
    assert partial == '{"city": "Oslo \\u00e9", "days": [1, 2]}'
    answer = await answered(steps(pieces, "eos_token"), TextOptions(), tools=True)
    assert answer["content"][0]["input"] == {"city": "Oslo é", "days": [1, 2]}
    assert answer["stop_reason"] == "tool_use"
    assert without_ids(as_answer(streamed_pairs)) == without_ids(answer)


@pytest.mark.parametrize("seed", range(8))
async def test_a_no_tool_answer_streams_as_text(seed: int) -> None:
    text = json.dumps({"name": NO_TOOL, "arguments": {"content": 'Hi "you" 🙂'}})
    pieces = splits(text, random.Random(seed))
    pairs = streamed(steps(pieces, "eos_token"), TextOptions(), tools=True)
    answer = await answered(steps(pieces, "eos_token"), TextOptions(), tools=True)
    assert answer["content"] == [{"type": "text", "text": 'Hi "you" 🙂'}]
    assert answer["stop_reason"] == "end_turn"
    assert as_answer(pairs) == answer


@pytest.mark.parametrize("seed", range(8))
async def test_streamed_text_never_shows_the_stop_sequence(seed: int) -> None:
    text = "Hello, STOP"
    pieces = splits(text, random.Random(seed))
    options = TextOptions(stop=("STOP", "zz"))
    pairs = streamed(steps(pieces, "stop_sequence"), options, tools=False)
    answer = await answered(steps(pieces, "stop_sequence"), options, tools=False)
    assert answer["content"] == [{"type": "text", "text": "Hello, "}]
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", "STOP")
    assert as_answer(pairs) == answer


async def test_an_empty_answer_is_one_empty_text_block() -> None:
    events = [StepEvent(tokens=[], finished=Finished("", 1, "eos_token", None))]
    for tools in (False, True):
        pairs = streamed(events, TextOptions(), tools=tools)
        answer = await answered(events, TextOptions(), tools=tools)
        assert answer["content"] == [{"type": "text", "text": ""}]
        assert as_answer(pairs) == answer


async def test_a_failure_is_the_last_event() -> None:
    channel = Channel(4)
    channel.push(StepEvent(tokens=[TokenInfo(id=1, text="a", logprob=-0.5)]))
    channel.push(ErrorEvent("the shard failed", "generation"))
    writer = MessageEvents("msg_1", "m", 4, TextOptions(), tools=False)
    pairs = parse([w async for w in event_stream([channel], writer)])
    assert pairs[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "the shard failed"}},
    )


QWEN3 = reasoning_parser("qwen3")
THOUGHT = "<think>\nOslo, in Norway.</think>\n\nOslo is cold STOP"


@pytest.mark.parametrize("seed", range(8))
async def test_thinking_streams_as_its_own_block_before_the_text(seed: int) -> None:
    pieces = splits(THOUGHT, random.Random(seed))
    options = TextOptions(stop=("STOP",))
    pairs = streamed(steps(pieces, "stop_sequence"), options, False, QWEN3)
    answer = await answered(steps(pieces, "stop_sequence"), options, False, QWEN3)
    assert answer["content"] == [
        {"type": "thinking", "thinking": "\nOslo, in Norway.", "signature": ""},
        {"type": "text", "text": "Oslo is cold "},
    ]
    assert as_answer(pairs) == answer
    blocks = [
        (n, d["index"])
        for n, d in pairs
        if n.startswith("content_block_") and n != "content_block_delta"
    ]
    assert blocks == [
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_stop", 1),
    ]


@pytest.mark.parametrize("seed", range(6))
async def test_thinking_then_a_call(seed: int) -> None:
    text = f"<think>use the tool</think>{CALL}"
    pieces = splits(text, random.Random(seed))
    pairs = streamed(steps(pieces, "eos_token"), TextOptions(), True, QWEN3)
    answer = await answered(steps(pieces, "eos_token"), TextOptions(), True, QWEN3)
    assert [block["type"] for block in answer["content"]] == ["thinking", "tool_use"]
    assert answer["stop_reason"] == "tool_use"
    assert without_ids(as_answer(pairs)) == without_ids(answer)


async def test_an_answer_cut_while_thinking_is_one_thinking_block() -> None:
    pieces = ["<think>", "still", " going"]
    pairs = streamed(steps(pieces, "length"), TextOptions(), False, QWEN3)
    answer = await answered(steps(pieces, "length"), TextOptions(), False, QWEN3)
    assert answer["content"] == [{"type": "thinking", "thinking": "still going", "signature": ""}]
    assert answer["stop_reason"] == "max_tokens"
    assert as_answer(pairs) == answer


async def test_without_thinking_the_parser_changes_nothing() -> None:
    pieces = ["Plain", " text."]
    pairs = streamed(steps(pieces, "eos_token"), TextOptions(), False, QWEN3)
    answer = await answered(steps(pieces, "eos_token"), TextOptions(), False, QWEN3)
    assert answer["content"] == [{"type": "text", "text": "Plain text."}]
    assert as_answer(pairs) == answer
