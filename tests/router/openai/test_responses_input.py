"""A Responses body as the chat pipeline reads it: messages, tool plans, grammars, sampling."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from textgate.router.config import RouterConfig
from textgate.router.generation.validation import ValidationError
from textgate.router.openai.responses_input import (
    check_stateless,
    format_grammar,
    generate_parameters,
    input_messages,
    tool_plan,
)
from textgate.router.openai.responses_schemas import ResponsesRequest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CONFIG = RouterConfig(model_id="m", tokenizer_path="unused", shard_uds_path="/tmp/unused")


def body(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_text_input_is_a_user_message_after_the_instructions() -> None:
    assert input_messages(body(instructions="Be brief.")) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_message_items_keep_their_text_and_developer_is_system() -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "b", "annotations": []}],
        },
    ]
    assert input_messages(body(input=items)) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]


def test_function_calls_and_outputs_become_chat_tool_messages() -> None:
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = input_messages(body(input=items))
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"},
            },
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_reasoning_items_sent_back_are_dropped() -> None:
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": []}
    said = {"role": "assistant", "content": "Paris."}
    items = [{"role": "user", "content": "w5"}, thought, said, {"role": "user", "content": "w6"}]
    assert input_messages(body(input=items)) == [
        {"role": "user", "content": "w5"},
        said,
        {"role": "user", "content": "w6"},
    ]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([], "`input` cannot be empty"),
        ([{"role": "tool", "content": "x"}], "`input[0]`.role must be"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "'input_image' are not"),
        ([{"type": "web_search_call"}], "items of type 'web_search_call' are not supported"),
        ([{"type": "item_reference", "id": "msg_1"}], "stateless"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "needs a string `call_id`"),
    ],
)
def test_unsupported_input_is_refused(items: list[Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        input_messages(body(input=items))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"previous_response_id": "resp_1"}, "`previous_response_id` is not supported"),
        ({"conversation": "conv_1"}, "`conversation` is not supported"),
        ({"background": True}, "`background` is not supported"),
        ({"top_logprobs": 2}, "`top_logprobs` is not supported"),
    ],
)
def test_what_needs_stored_state_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        check_stateless(body(**fields))
    check_stateless(body(store=True, previous_response_id=None))


def call_schema(**fields: Any) -> dict[str, Any]:
    plan = tool_plan(body(**fields))
    assert plan is not None
    schema: dict[str, Any] = json.loads(plan.grammar.value)
    return schema


def test_flat_function_tools_become_a_plan() -> None:
    auto = call_schema(tools=[WEATHER])
    assert [c["properties"]["name"] for c in auto["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "no_tool"},
    ]
    named = call_schema(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named["properties"]["name"] == {"const": "get_weather"}
    assert named["properties"]["arguments"] == WEATHER["parameters"]
    assert tool_plan(body(tools=[WEATHER], tool_choice="none")) is None
    assert tool_plan(body()) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "only function tools are supported"),
        ({"tools": [{**WEATHER, "name": "a b"}]}, r"`tools\[0\]`.name must be"),
        ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "`tool_choice` must be"),
        (
            {"tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
            "`text.format` cannot be combined with `tools`",
        ),
    ],
)
def test_bad_tools_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        tool_plan(body(**fields))


def test_text_format_is_a_grammar() -> None:
    assert format_grammar(body()) is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    grammar = format_grammar(body(text={"format": spec}))
    assert grammar is not None and json.loads(grammar.value) == schema
    any_object = format_grammar(body(text={"format": {"type": "json_object"}}))
    assert any_object is not None and json.loads(any_object.value)["type"] == "object"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "xml"}, "`text.format` type must be"),
        ({"type": "json_schema", "schema": {}}, "needs `name` and `schema`"),
        ({"type": "json_schema", "name": "x", "schema": {"type": 5}}, "`text.format` schema"),
    ],
)
def test_bad_text_formats_are_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        format_grammar(body(text={"format": spec}))


def test_sampling_is_chats() -> None:
    greedy = generate_parameters(body(temperature=0, max_output_tokens=5), CONFIG, None)
    assert not greedy.do_sample and greedy.max_new_tokens == 5
    sampled = generate_parameters(body(temperature=0.5, top_p=0.9), CONFIG, None)
    assert sampled.do_sample and sampled.temperature == 0.5 and sampled.top_p == 0.9
    with pytest.raises(ValidationError, match="`max_output_tokens` must be >= 1"):
        generate_parameters(body(max_output_tokens=0), CONFIG, None)
    with pytest.raises(ValidationError, match="`top_p`"):
        generate_parameters(body(top_p=0), CONFIG, None)
