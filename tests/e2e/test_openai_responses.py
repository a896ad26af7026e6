"""End to end: the `openai` SDK's Responses API (`client.responses`) against the launcher
serving the embedded default model (float32, greedy: the same answer every time).

`responses.stream` rebuilds the response from the typed events itself and checks their
identities and order; its final response must be the non-streamed one, item by item.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI, UnprocessableEntityError
from pydantic import BaseModel

pytestmark = pytest.mark.e2e

MODEL = "tgi"
QUESTION = "Name the capital of France."
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Capital(BaseModel):
    country: str
    city: str


@pytest.fixture(scope="module")
def client(live_server: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{live_server}/v1", api_key="-", timeout=120, max_retries=0) as openai:
        yield openai


def items(response: Any) -> list[dict[str, Any]]:
    """The output items without their ids (fresh in every response) and what the SDK's
    stream adds (`parsed_arguments`)."""
    out = [item.model_dump(exclude_none=True) for item in response.output]
    left_out = ("id", "call_id", "parsed_arguments")
    return [{k: v for k, v in item.items() if k not in left_out} for item in out]


def test_create_answers_paris(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        instructions="Answer in one short sentence.",
        input=QUESTION,
        temperature=0,
        max_output_tokens=40,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed"
    assert "Paris" in response.output_text
    assert response.output[0].type == "message"
    assert response.usage is not None and response.usage.output_tokens > 0
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_a_message_array_and_a_cut_answer_is_incomplete(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "You are a geography teacher."},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        temperature=0,
        max_output_tokens=3,
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


def test_stream_gives_the_same_response(client: OpenAI) -> None:
    fields: Any = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 40}
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert items(final) == items(whole)
    assert final.usage == whole.usage


def test_create_with_stream_true_sends_typed_events(client: OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_json_schema_format_is_parsed(client: OpenAI) -> None:
    response = client.responses.parse(
        model=MODEL,
        input="What is the capital of France? Answer in JSON.",
        text_format=Capital,
        temperature=0,
        max_output_tokens=60,
    )
    parsed = response.output_parsed
    assert isinstance(parsed, Capital)
    assert "Paris" in parsed.city


def test_a_function_tool_is_called_and_its_result_answered(client: OpenAI) -> None:
    question: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id.startswith("call_")
    assert "Paris" in json.loads(item.arguments)["city"]
    result: Any = {"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 24C"}
    answer = client.responses.create(
        model=MODEL,
        input=[*question, *call.output, result],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert answer.output[0].type == "message" and answer.output_text


def test_a_streamed_call_is_the_same_call(client: OpenAI) -> None:
    fields: Any = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 60,
    }
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert items(final) == items(whole)
    assert "".join(deltas) == final.output[0].arguments  # type: ignore[union-attr]


def test_previous_response_id_is_a_typed_error(client: OpenAI) -> None:
    with pytest.raises(UnprocessableEntityError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(caught.value)
    assert "stateless" in str(caught.value)
    assert caught.value.type == "invalid_request_error"
