"""OpenAI `tools`, `tool_choice` and `response_format` as tool plans, grammars and tool calls.

`tools` are `{"type": "function", "function": {"name", "description", "parameters"}}`;
`tool_choice` "auto" (the default with tools), "required", "none", or a named function.
How a plan becomes a grammar and a prompt, for every API alike, is
router/generation/tools.py; how a generated call object is read back (and streamed)
is router/generation/answer.py and router/openai/answer.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from textgate.router.engine.request import GrammarSpec
from textgate.router.generation.grammar import GrammarSpecError, json_schema_grammar
from textgate.router.generation.tools import (
    EMPTY_PARAMETERS,
    Tool,
    ToolPlan,
    check_tool_name,
    check_tools,
    plan_tools,
)
from textgate.router.generation.validation import ValidationError
from textgate.router.openai.schemas import ChatCompletionRequest, ToolCall, ToolCallFunction


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; None when it calls no tools (none given, or "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise ValidationError("`tool_choice` needs `tools`")
        return None
    tools = tuple(_tool(i, t) for i, t in enumerate(body.tools))
    check_tools(tools)
    if choice == "none":
        return None
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise ValidationError(
            '`response_format` cannot be combined with `tools` (unless `tool_choice` is "none")'
        )
    auto = choice in (None, "auto")
    name = None if choice in (None, "auto", "required") else _named_choice(choice)
    return plan_tools(tools, auto=auto, name=name)


def response_format_grammar(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    """The grammar of `response_format`: json_object (any JSON object), json_schema."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return json_schema_grammar({"type": "object", "additionalProperties": True})
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValidationError(
                    '`response_format` json_schema needs `json_schema` {"name": ..., '
                    '"schema": {...}}'
                )
            # `strict` or not, the schema is enforced (the grammar admits nothing else).
            return json_schema_grammar(spec.get("schema", {}))
    except GrammarSpecError as exc:
        raise ValidationError(f"`response_format` schema: {exc}") from None
    raise ValidationError(
        f'`response_format` type must be "text", "json_object" or "json_schema". Given: {kind!r}'
    )


def new_call(name: str, arguments: str) -> ToolCall:
    """A tool call with a fresh id."""
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=ToolCallFunction(name=name, arguments=arguments),
    )


def _tool(index: int, tool: Any) -> Tool:
    where = f"`tools[{index}]`"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValidationError(f'{where} must be {{"type": "function", "function": {{...}}}}')
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError(f"{where}.function needs a `name`")
    name = function["name"]
    check_tool_name(name, f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValidationError(f"{where}.function.parameters must be a JSON schema object")
    description = function.get("description") or ""
    return Tool(name=name, description=str(description), parameters=parameters)


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") == "function" and isinstance(function, dict):
            name = function.get("name")
            if isinstance(name, str):
                return name
    raise ValidationError(
        '`tool_choice` must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )
