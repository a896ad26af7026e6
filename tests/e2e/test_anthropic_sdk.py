"""End to end: the `anthropic` SDK against the launcher serving the embedded default model.

Messages streamed and not (the stream assembles to the same message), a forced tool
call, token counting, and bad requests raising the SDK's typed exceptions. The SDK no
longer types `temperature`; older SDKs and other clients send it, so it goes in the body
(`extra_body`): greedy answers make the stream and the answer comparable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from anthropic import Anthropic, BadRequestError, NotFoundError
from anthropic.types import MessageParam

pytestmark = pytest.mark.e2e

MODEL = "tgi"
SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION: list[MessageParam] = [{"role": "user", "content": "Name the capital of France."}]
GREEDY: Any = {"temperature": 0}
WEATHER: Any = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(live_server: str) -> Iterator[Anthropic]:
    with Anthropic(base_url=live_server, api_key="-", timeout=120, max_retries=0) as anthropic:
        yield anthropic


def test_a_message_answers_paris(client: Anthropic) -> None:
    message = client.messages.create(
        model=MODEL,
        max_tokens=20,
        system="Answer briefly.",
        messages=QUESTION,
        extra_body=GREEDY,
    )
    assert message.id.startswith("msg_")
    assert message.model == SERVED and message.role == "assistant"
    (block,) = message.content
    assert block.type == "text" and "Paris" in block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 20


def test_the_stream_assembles_to_the_same_message(client: Anthropic) -> None:
    fields: Any = {"model": MODEL, "max_tokens": 20, "messages": QUESTION, "extra_body": GREEDY}
    answer = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert answer.content[0].type == "text"
    assert text == answer.content[0].text
    # The stream's blocks are the SDK's parsed kind (with a `parsed_output`): same fields.
    blocks = [block.model_dump(exclude={"parsed_output"}) for block in streamed.content]
    assert blocks == [block.model_dump() for block in answer.content]
    assert (streamed.stop_reason, streamed.usage) == (answer.stop_reason, answer.usage)


def test_a_forced_tool_call_has_its_input_object(client: Anthropic) -> None:
    fields: Any = {
        "model": MODEL,
        "max_tokens": 60,
        "extra_body": GREEDY,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }
    message = client.messages.create(**fields)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_") and isinstance(block.input, dict)
    assert isinstance(block.input.get("city"), str)
    assert message.stop_reason == "tool_use"
    with client.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    (call,) = streamed.content
    assert call.type == "tool_use" and call.input == block.input


def test_count_tokens_counts_the_prompt(client: Anthropic) -> None:
    count = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    message = client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION)
    assert count.input_tokens == message.usage.input_tokens


def test_bad_requests_raise_the_sdks_typed_errors(client: Anthropic) -> None:
    with pytest.raises(BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=QUESTION)
    assert "`max_tokens` must be >= 1" in str(bad.value)
    with pytest.raises(BadRequestError, match="temperature"):
        client.messages.create(
            model=MODEL, max_tokens=1, messages=QUESTION, extra_body={"temperature": 2}
        )
    with pytest.raises(NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=1, messages=QUESTION)
