"""Anthropic turns and tools as chat-template messages and tool plans."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from textgate.router.anthropic.prompt import continues_last_turn, template_messages, tool_plan
from textgate.router.anthropic.schemas import CountTokensRequest
from textgate.router.generation.tools import NO_TOOL
from textgate.router.generation.validation import ValidationError

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def request(messages: list[dict[str, Any]], **fields: Any) -> CountTokensRequest:
    return CountTokensRequest.model_validate({"messages": messages, **fields})


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages() -> None:
    body = request(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "cold"}],
                    },
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
        system="Be brief.",
    )
    messages = template_messages(body)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "Weather in Oslo?"}
    (call,) = messages[2]["tool_calls"]
    assert messages[2]["content"] == "Let me look."
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "cold"}
    assert messages[4] == {"role": "user", "content": "And now?"}
    assert not continues_last_turn(body)


def test_a_failed_tool_result_says_so() -> None:
    block = {"type": "tool_result", "tool_use_id": "t", "content": "no such city", "is_error": True}
    (result,) = template_messages(request([{"role": "user", "content": [block]}]))
    assert result == {"role": "tool", "tool_call_id": "t", "content": "Error: no such city"}


def test_tool_choice_picks_the_plan() -> None:
    auto = tool_plan(request([], tools=[WEATHER]))
    assert auto is not None and auto.auto
    schema = json.loads(auto.grammar.value)
    jsonschema.validate({"name": NO_TOOL, "arguments": {"content": "hi"}}, schema)
    forced = tool_plan(request([], tools=[WEATHER], tool_choice={"type": "any"}))
    assert forced is not None and not forced.auto
    named = tool_plan(
        request([], tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    )
    assert named is not None and [t.name for t in named.tools] == ["get_weather"]
    assert tool_plan(request([], tools=[WEATHER], tool_choice={"type": "none"})) is None
    assert tool_plan(request([])) is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs the tool's `name`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, "not in `tools`"),
        ({"tools": [WEATHER, WEATHER]}, "must be unique"),
        ({"tools": [{**WEATHER, "name": NO_TOOL}]}, "reserved"),
    ],
)
def test_bad_tools_are_refused(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        tool_plan(request([], **fields))


def test_blocks_a_turn_cannot_hold_are_refused() -> None:
    tool_use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    with pytest.raises(ValidationError, match="tool_use"):
        template_messages(request([{"role": "user", "content": [tool_use]}]))
    with pytest.raises(ValidationError, match="only text blocks"):
        template_messages(request([], system=[{"type": "image"}]))
