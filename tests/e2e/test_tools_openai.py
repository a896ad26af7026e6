"""End to end: tool calls and json_schema answers through the `openai` SDK (the default model).

The SDK assembles streamed tool-call deltas itself (`chat.completions.stream`) and
parses json_schema answers into pydantic models (`chat.completions.parse`). A stream says
exactly what the non-streamed answer of the same seed says, field by field, read the way
simple clients read it (each chunk's first tool-call entry).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageParam
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e

MODEL = "tgi"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                "required": ["zone"],
            },
        },
    },
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]


# Issue 31's reproduction: a city and an enum, "required", sampled (seed), 80 tokens.
UNIT_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
]  # fmt: skip
# Nested objects, arrays, free strings (escapes, unicode): "auto" may answer in text.
TRIP_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "plan_trip",
            "description": "Plan a trip: stops with notes",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 40},
                    "stops": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "nights": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "nights"]}},
                    "options": {"type": "object", "properties": {"note": {"type": "string", "maxLength": 30}, "budget": {"type": "number"}}, "required": ["note"]},
                },
                "required": ["title", "stops", "options"],
            },
        },
    }
]  # fmt: skip


@pytest.fixture(scope="module")
def client(live_server: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{live_server}/v1", api_key="-", timeout=120, max_retries=0) as openai:
        yield openai


def _weather_call(message: ChatCompletionMessage) -> dict[str, Any]:
    (call,) = message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS)
    return arguments


@pytest.mark.parametrize("tool_choice", ["auto", "named"])
def test_tool_call(client: OpenAI, tool_choice: str) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        # Given both tools, this 135M model answers "auto" in text; with one it calls.
        tools=TOOLS if tool_choice == "named" else TOOLS[:1],
        tool_choice=NAMED if tool_choice == "named" else "auto",
        temperature=0,
        max_tokens=40,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert _weather_call(choice.message) == {"city": "Paris"}


@pytest.mark.parametrize("tool_choice", ["auto", "named"])
def test_streamed_tool_call_is_assembled_by_the_sdk(client: OpenAI, tool_choice: str) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=QUESTION,
        # Given both tools, this 135M model answers "auto" in text; with one it calls.
        tools=TOOLS if tool_choice == "named" else TOOLS[:1],
        tool_choice=NAMED if tool_choice == "named" else "auto",
        temperature=0,
        max_tokens=40,
    ) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1  # the arguments came in pieces
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _weather_call(choice.message) == {"city": "Paris"}


def test_tool_choice_none_answers_in_text(client: OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_a_tool_result_can_be_sent_back(client: OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=40, temperature=0
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: list[ChatCompletionMessageParam] = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert answer.choices[0].message.content


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


def test_json_schema_response_is_parsed_by_the_sdk(client: OpenAI) -> None:
    answer = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, City)
    jsonschema.validate(
        json.loads(answer.choices[0].message.content or ""), City.model_json_schema()
    )


def test_json_object_response_is_an_object(client: OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


def _streamed(
    client: OpenAI, **request: Any
) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """Content, calls (name, arguments) and finish reason as the chunks' first entries
    spell them; each chunk has at most one entry per call."""
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            entries = choice.delta.tool_calls or []
            assert len({entry.index for entry in entries}) == len(entries), entries
            if entries:
                first = entries[0]
                if first.index == len(calls):
                    assert first.id and first.function and first.function.name
                    calls.append([first.function.name, ""])
                calls[first.index][1] += (first.function and first.function.arguments) or ""
            reason = choice.finish_reason or reason
    return content or None, [(name, arguments) for name, arguments in calls], reason


def _answered(
    client: OpenAI, **request: Any
) -> tuple[str | None, list[tuple[str, str]], str | None]:
    choice = client.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content or None, calls, choice.finish_reason


def test_streamed_tool_call_arguments_join_to_the_answers_for_every_seed(client: OpenAI) -> None:
    # Issue 31: seed 8 streamed `"city": "Rome", "unit": "c"}` (its `{` in a second entry
    # of the chunk that named the call) where the answer was `{"city": ...}`.
    request: dict[str, Any] = {"model": MODEL, "tools": UNIT_TOOLS, "tool_choice": "required"}
    request |= {"messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 80}
    for seed in range(12):
        streamed, answered = (
            _streamed(client, **request, seed=seed),
            _answered(client, **request, seed=seed),
        )
        assert streamed == answered, f"seed {seed}"
        content, [(name, arguments)], _ = answered
        assert content is None and name == "get_weather"
        jsonschema.validate(json.loads(arguments), UNIT_TOOLS[0]["function"]["parameters"])


def test_streams_of_nested_calls_and_text_answers_say_what_the_answers_say(client: OpenAI) -> None:
    question = 'Plan a 2-stop trip: Zürich then Kraków, "cheap" — note it in one line.'
    request: dict[str, Any] = {"model": MODEL, "tools": TRIP_TOOLS, "tool_choice": "auto"}
    request |= {"messages": [{"role": "user", "content": question}], "max_tokens": 80}
    for seed in range(3):
        streamed, answered = (
            _streamed(client, **request, seed=seed),
            _answered(client, **request, seed=seed),
        )
        assert streamed == answered, f"seed {seed}"
        content, calls, _ = answered
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), TRIP_TOOLS[0]["function"]["parameters"])
        assert calls or content
