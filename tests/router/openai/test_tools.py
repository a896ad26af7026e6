"""OpenAI tools: plans and their grammars, prompts (reading calls back: test_answer.py)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from textgate.router.generation.tools import NO_TOOL, template_reads_tools, tool_messages
from textgate.router.generation.validation import ValidationError
from textgate.router.openai.schemas import ChatCompletionRequest
from textgate.router.openai.tools import response_format_grammar, tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def grammar_schema(**fields: Any) -> dict[str, Any]:
    plan = tool_plan(chat(**fields))
    assert plan is not None and plan.grammar.kind == "json"
    schema: dict[str, Any] = json.loads(plan.grammar.value)
    return schema


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def test_required_admits_a_call_of_any_tool_and_nothing_else() -> None:
    schema = grammar_schema(tools=[WEATHER, TIME], tool_choice="required")
    jsonschema.validate(call("get_weather", {"city": "Paris"}), schema)
    jsonschema.validate(call("get_time", {}), schema)
    for wrong in (call("get_weather", {}), call(NO_TOOL, {"content": "x"}), call("nope", {})):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_auto_also_admits_answering_in_text() -> None:
    schema = grammar_schema(tools=[WEATHER])
    jsonschema.validate(call(NO_TOOL, {"content": "hello"}), schema)
    jsonschema.validate(call("get_weather", {"city": "Paris"}), schema)


def test_a_named_choice_admits_that_function_only() -> None:
    schema = grammar_schema(tools=[WEATHER, TIME], tool_choice=NAMED)
    jsonschema.validate(call("get_time", {}), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(call("get_weather", {"city": "Paris"}), schema)


def test_none_and_no_tools_have_no_plan() -> None:
    assert tool_plan(chat(tools=[WEATHER], tool_choice="none")) is None
    assert tool_plan(chat()) is None
    assert tool_plan(chat(tool_choice="auto")) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "`tool_choice` must be"),
        ({"tools": [WEATHER], "tool_choice": NAMED}, "names `get_time`, which is not"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": NO_TOOL}}]}, "reserved"),
        ({"tools": [{"type": "retrieval"}]}, "`tools[0]` must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters, digits"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "must be a JSON schema object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "not a valid JSON schema",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)
def test_bad_tool_requests_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[")):
        tool_plan(chat(**fields))


def test_response_formats() -> None:
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    spec = response_format_grammar({"type": "json_object"})
    assert spec is not None and json.loads(spec.value)["type"] == "object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    )
    assert spec is not None and json.loads(spec.value) == schema
    with pytest.raises(ValidationError, match="`response_format` schema: not a valid"):
        response_format_grammar(
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 2}}}
        )


def test_templates_without_tools_get_a_system_prompt_and_calls_as_text() -> None:
    plan = tool_plan(chat(tools=[WEATHER]))
    assert plan is not None
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    rendered = tool_messages(history, plan, template_tools=False)
    assert rendered[0]["content"].startswith("Be brief.\n\n")
    assert "get_weather" in rendered[0]["content"] and NO_TOOL in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == call("get_weather", {"city": "Oslo"})
    assert "tool_calls" not in rendered[2]
    assert rendered[3] == {"role": "tool", "content": "cold"}
    assert tool_messages(history, plan, template_tools=True) == history


def test_template_reads_tools() -> None:
    class Tokenizer:
        chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}"

    assert template_reads_tools(Tokenizer())
    Tokenizer.chat_template = "{{ messages }}"
    assert not template_reads_tools(Tokenizer())


def test_a_tools_template_renders_the_tools_itself() -> None:
    from textgate.router.generation.chat_template import render_chat

    seen: dict[str, Any] = {}

    class Tokenizer:
        chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}"

        def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
            seen.update(kwargs)
            return "prompt"

    plan = tool_plan(chat(tools=[WEATHER]))
    assert plan is not None
    tools = [t.as_openai() for t in plan.tools]
    assert render_chat(Tokenizer(), [{"role": "user", "content": "hi"}], tools=tools) == "prompt"
    assert seen["tools"] == [WEATHER]
    seen.clear()
    render_chat(Tokenizer(), [{"role": "user", "content": "hi"}])
    assert "tools" not in seen  # templates without tools never get the keyword
