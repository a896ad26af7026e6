"""OpenAI `tools`, `tool_choice` and `response_format` as tool plans, grammars and tool calls.

`tools` are `{"type": "function", "function": {"name", "description", "parameters"}}`;
`tool_choice` "auto" (the default with tools), "required", "none", or a named function.
How a plan becomes a grammar and a prompt, for every API alike, is
router/generation/tools.py; how a generated call object is read back (and streamed)
is router/generation/answer.py and router/openai/answer.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from textgate.router.engine.request import GrammarSpec
from textgate.router.generation.grammar import GrammarSpecError, json_schema_grammar
from textgate.router.generation.tools import (
    Tool,
    ToolPlan,
    check_tools,
    function_tool,
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
    constrained = body.response_format is not None and body.response_format.get("type") != "text"
    return choice_plan(tools, choice, _named_choice, "response_format" if constrained else None)


def choice_plan(
    tools: tuple[Tool, ...],
    choice: Any,
    named: Callable[[Any], str],
    format_field: str | None = None,
) -> ToolPlan | None:
    """The plan of OpenAI's `tool_choice` over `tools` (chat's and Responses' alike):
    "auto" (None too), "required", "none" (no plan), or a function that `named` reads the
    name of. `format_field` names a format constraint the request also set (refused)."""
    check_tools(tools)
    if choice == "none":
        return None
    if format_field is not None:
        raise ValidationError(
            f'`{format_field}` cannot be combined with `tools` (unless `tool_choice` is "none")'
        )
    if choice in (None, "auto", "required"):
        return plan_tools(tools, auto=choice != "required")
    return plan_tools(tools, auto=False, name=named(choice))


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
    fields = (function["name"], function.get("description"), function.get("parameters"))
    return function_tool(*fields, f"{where}.function")


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
