"""An Anthropic request as the messages a chat template reads, and its tool plan.

Chat templates read OpenAI-shaped messages, so the request is spelled that way:
`system` (text or text blocks) becomes the first, system, message; text blocks are
joined with newlines; an assistant's `tool_use` blocks become its `tool_calls`
(arguments as JSON text); a user's `tool_result` blocks become `tool` messages (before
the rest of that turn's text), a failed one marked as such. `thinking` blocks of earlier
turns are dropped. Images, documents and other blocks are refused (400). A last
assistant turn is a prefix the answer continues, as Anthropic does.
"""

from __future__ import annotations

import json
from typing import Any

from textgate.router.anthropic.schemas import (
    ContentBlock,
    CountTokensRequest,
    InputMessage,
    ToolChoice,
    ToolSpec,
)
from textgate.router.generation.tools import (
    Tool,
    ToolPlan,
    check_tool_name,
    check_tools,
    plan_tools,
)
from textgate.router.generation.validation import ValidationError

_DROPPED = frozenset({"thinking", "redacted_thinking"})


def template_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and turns as chat template messages."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _system_text(body.system)})
    for index, message in enumerate(body.messages):
        messages += _turn(index, message)
    return messages


def continues_last_turn(body: CountTokensRequest) -> bool:
    """The last turn is the assistant's: the answer continues it (a prefill)."""
    return bool(body.messages) and body.messages[-1].role == "assistant"


def tool_plan(body: CountTokensRequest) -> ToolPlan | None:
    """The request's tool plan; None when it calls no tools (none given, or "none")."""
    choice = body.tool_choice or ToolChoice(type="auto")
    if not body.tools:
        if choice.type in ("any", "tool"):
            raise ValidationError(f'`tool_choice` "{choice.type}" needs `tools`')
        return None
    tools = tuple(_tool(index, spec) for index, spec in enumerate(body.tools))
    check_tools(tools)
    if choice.type == "none":
        return None
    if choice.type == "tool" and choice.name is None:
        raise ValidationError('`tool_choice` "tool" needs the tool\'s `name`')
    name = choice.name if choice.type == "tool" else None
    return plan_tools(tools, auto=choice.type == "auto", name=name)


def _tool(index: int, spec: ToolSpec) -> Tool:
    where = f"`tools[{index}]`"
    if spec.type not in (None, "custom"):
        raise ValidationError(
            f"{where}: tools of type {spec.type!r} are not supported: only client tools "
            "(`name`, `description`, `input_schema`)"
        )
    check_tool_name(spec.name, f"{where}.name")
    return Tool(name=spec.name, description=spec.description, parameters=spec.input_schema)


def _system_text(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_text_of(block, "`system`") for block in system)


def _turn(index: int, message: InputMessage) -> list[dict[str, Any]]:
    """One turn as template messages: its tool results, then its text and calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    where = f"`messages[{index}]`"
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "text":
            texts.append(_text_of(block, where))
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(_call(block, where))
        elif block.type == "tool_result" and message.role == "user":
            results.append(_result(block, where))
        elif block.type not in _DROPPED:
            raise ValidationError(
                f"{where}: content blocks of type {block.type!r} are not supported in a "
                f"{message.role} turn: only text, tool_use (assistant) and tool_result (user)"
            )
    turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _text_of(block: ContentBlock, where: str) -> str:
    if block.type != "text" or block.text is None:
        raise ValidationError(f"{where}: only text blocks are supported here, not {block.type!r}")
    return block.text


def _call(block: ContentBlock, where: str) -> dict[str, Any]:
    if block.name is None or block.id is None:
        raise ValidationError(f"{where}: a tool_use block needs `id` and `name`")
    arguments = json.dumps(block.input or {})
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


def _result(block: ContentBlock, where: str) -> dict[str, Any]:
    if block.tool_use_id is None:
        raise ValidationError(f"{where}: a tool_result block needs `tool_use_id`")
    content = block.content
    text = (
        content
        if isinstance(content, str)
        else "\n".join(_text_of(part, where) for part in content or [])
    )
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
