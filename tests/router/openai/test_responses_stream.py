"""A streamed response's typed events, without a server: they add up to the non-streamed
response of the same text, tool calls and thinking included, wherever the token
boundaries fall."""

from __future__ import annotations

import json
from typing import Any

import pytest

from textgate.router.engine.channel import ErrorEvent, Finished, FinishReason, StepEvent, TokenInfo
from textgate.router.generation.reasoning import ReasoningParser, reasoning_parser
from textgate.router.generation.result import Generated
from textgate.router.openai.responses_output import ResponseHead, completed_response
from textgate.router.openai.responses_schemas import ResponsesRequest
from textgate.router.openai.responses_stream import ResponseEvents

HEAD = ResponseHead("resp_1", 1, "m", ResponsesRequest(input="hi"))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris \\"15e\\""}}'
NO_TOOL = '{"name": "no_tool", "arguments": {"content": "It is \\u00e9t\\u00e9."}}'


def events_of(writes: list[bytes]) -> list[dict[str, Any]]:
    frames = [f for w in writes for f in w.decode().split("\n\n")[:-1]]
    return [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]


QWEN3 = reasoning_parser("qwen3")
R1 = reasoning_parser("deepseek_r1")


def stream(
    pieces: list[str],
    reason: FinishReason,
    *,
    tools: bool,
    reasoning: ReasoningParser | None = None,
) -> list[dict[str, Any]]:
    writer = ResponseEvents(HEAD, 4, tools=tools, reasoning=reasoning)
    writes = [writer.opening()]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        done = Finished("".join(pieces), len(pieces), reason, None) if last else None
        writes.append(writer.step(0, StepEvent([TokenInfo(i, piece, -0.1)], finished=done)))
    writes.append(writer.closing(None, len(pieces)))
    return events_of(writes)


def whole(
    text: str,
    reason: FinishReason,
    num_tokens: int,
    *,
    tools: bool,
    reasoning: ReasoningParser | None = None,
    pieces: list[str] | None = None,
) -> dict[str, Any]:
    tokens = [TokenInfo(i, piece, -0.1) for i, piece in enumerate(pieces or [])]
    generated = Generated(Finished(text, num_tokens, reason, None), 4, 0.0, 0.0, tokens)
    return completed_response(HEAD, generated, 4, tools, reasoning).model_dump(mode="json")


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("size", [1, 3, 7, 100])
@pytest.mark.parametrize(("text", "tools"), [(CALL, True), (NO_TOOL, True), ("Hello!", False)])
def test_the_stream_adds_up_to_the_whole_response(size: int, text: str, tools: bool) -> None:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    events = stream(pieces, "eos_token", tools=tools)
    expected = whole(text, "eos_token", len(pieces), tools=tools)
    final = events[-1]
    assert final["type"] == "response.completed"
    assert without_ids(final["response"]["output"]) == without_ids(expected["output"])
    assert final["response"]["usage"] == expected["usage"]
    (item,) = final["response"]["output"]
    if item["type"] == "function_call":
        deltas = [
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        ]
        assert "".join(deltas) == item["arguments"] == '{"city": "Paris \\"15e\\""}'
        (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert done["arguments"] == item["arguments"] and done["name"] == "get_weather"
    else:
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(deltas) == item["content"][0]["text"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["id"] for e in added] == [item["id"]]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_an_empty_answer_is_an_empty_message() -> None:
    events = stream([""], "eos_token", tools=False)
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_cut_call_is_incomplete_and_said_as_it_is() -> None:
    text = CALL[:30]
    events = stream([text[:20], text[20:]], "length", tools=True)
    expected = whole(text, "length", 2, tools=True)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert without_ids(final["output"]) == without_ids(expected["output"])


def test_a_failure_sends_error_then_failed() -> None:
    writer = ResponseEvents(HEAD, 4, tools=False)
    writer.opening()
    writer.step(0, StepEvent([TokenInfo(1, "Hel", -0.1)]))
    events = events_of([writer.closing(ErrorEvent("boom", "generation"), 1)])
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[0]["code"] == "generation" and events[0]["message"] == "boom"
    failed = events[1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error",
        "message": "boom",
    }
    assert failed["output"][0]["content"][0]["text"] == "Hel"


THOUGHT = ["<think>", "\nHmm", ", Paris", "</think>", "\n\n", "Paris."]


@pytest.mark.parametrize(
    ("pieces", "reason", "tools", "parser", "items", "thinking_tokens"),
    [
        (
            THOUGHT,
            "eos_token",
            False,
            QWEN3,
            [("reasoning", "completed"), ("message", "completed")],
            4,
        ),
        (THOUGHT[:3], "length", False, QWEN3, [("reasoning", "incomplete")], 3),
        (
            ["Hmm", "</think>", CALL],
            "eos_token",
            True,
            R1,
            [("reasoning", "completed"), ("function_call", "completed")],
            2,
        ),
        (["<think>", "x", "</think>"], "eos_token", False, QWEN3, [("reasoning", "completed")], 3),
        (["Straight", " on."], "eos_token", False, QWEN3, [("message", "completed")], 0),
    ],
    ids=["answered", "cut-while-thinking", "then-a-call", "no-answer", "no-thinking"],
)
def test_thinking_is_a_reasoning_item_before_the_answer(
    pieces: list[str],
    reason: FinishReason,
    tools: bool,
    parser: ReasoningParser,
    items: list[tuple[str, str]],
    thinking_tokens: int,
) -> None:
    events = stream(pieces, reason, tools=tools, reasoning=parser)
    expected = whole(
        "".join(pieces), reason, len(pieces), tools=tools, reasoning=parser, pieces=pieces
    )
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(expected["output"])
    assert [(item["type"], item["status"]) for item in final["output"]] == items
    usage = final["usage"]
    assert usage == expected["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == thinking_tokens
    if items[0][0] != "reasoning":
        assert not [e for e in events if "reasoning" in e["type"]]
        return
    thought = final["output"][0]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought["content"][0]["text"]
    assert thought["summary"] == [] and "</think>" not in "".join(deltas)
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == thought["content"][0]["text"]
    # The reasoning item is done before the answer's first event.
    types = [e["type"] for e in events]
    answer_events = [i for i, e in enumerate(events) if e.get("output_index") == 1]
    closed = types.index("response.output_item.done")
    assert not answer_events or closed < answer_events[0]


def test_the_thinking_and_answer_are_read_apart() -> None:
    final = whole("".join(THOUGHT), "eos_token", 6, tools=False, reasoning=QWEN3, pieces=THOUGHT)
    thought, message = final["output"]
    assert thought["content"] == [{"type": "reasoning_text", "text": "\nHmm, Paris"}]
    assert message["content"][0]["text"] == "Paris."
