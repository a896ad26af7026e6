"""End to end: tool calls and json_schema answers through the `openai` SDK (the default model).

The SDK assembles streamed tool-call deltas itself (`chat.completions.stream`) and
parses json_schema answers into pydantic models (`chat.completions.parse`).
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
