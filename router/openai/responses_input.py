"""A Responses request as what the chat pipeline reads: template messages, a tool plan,
a grammar and the canonical `GenerateParameters`.

- `input` (text, or items) and `instructions` become chat-template messages:
  `instructions` a system message, `developer` messages system ones, `input_text` /
  `output_text` parts their text, `function_call` items an assistant message's
  `tool_calls`, `function_call_output` items `tool` messages (OpenAI's chat shapes, which
  router/generation/tools.py renders for templates with or without tools).
- `tools` (Responses' flat function shape) and `tool_choice` become a tool plan;
  `text.format` a grammar, as `response_format` is for chat.
- Sampling is chat's (router/openai/params.py), so the same values mean the same there.

Statelessness is said, not assumed: `previous_response_id`, `conversation`,
`background` and `item_reference` items need stored state and are refused (422).
"""

from __future__ import annotations

from typing import Any

from textgate.router.config import RouterConfig
from textgate.router.engine.request import GrammarSpec
from textgate.router.generation.grammar import GrammarSpecError, json_schema_grammar
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.generation.tools import (
    Tool,
    ToolPlan,
    function_tool,
)
from textgate.router.generation.validation import ValidationError
from textgate.router.openai.params import chat_parameters
from textgate.router.openai.responses_schemas import ResponsesRequest
from textgate.router.openai.schemas import ChatCompletionRequest
from textgate.router.openai.tools import choice_plan

ANY_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
STATELESS = "this server is stateless: nothing is stored"


def check_stateless(body: ResponsesRequest) -> None:
    """ValidationError for what needs a stored response or conversation."""
    if body.previous_response_id is not None:
        raise ValidationError(
            f"`previous_response_id` is not supported ({STATELESS}): send the whole "
            "conversation in `input`, earlier `output` items included"
        )
    if body.conversation is not None:
        raise ValidationError(f"`conversation` is not supported ({STATELESS})")
    if body.background:
        raise ValidationError("`background` is not supported: responses are answered at once")
    if body.top_logprobs:
        raise ValidationError("`top_logprobs` is not supported on /v1/responses")


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat-template messages of `instructions` and `input`."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for index, item in enumerate(body.input):
        _add_item(messages, item, f"`input[{index}]`")
    if len(messages) == (1 if body.instructions else 0):
        raise ValidationError("`input` cannot be empty")
    return messages


def tool_plan(body: ResponsesRequest) -> ToolPlan | None:
    """The request's tool plan; None when it calls no tools (none given, or "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in ("none", "auto"):
            raise ValidationError("`tool_choice` needs `tools`")
        return None
    tools = tuple(_tool(i, t) for i, t in enumerate(body.tools))
    constrained = body.text.format.get("type") != "text"
    return choice_plan(tools, choice, _named_choice, "text.format" if constrained else None)


def format_grammar(body: ResponsesRequest) -> GrammarSpec | None:
    """The grammar of `text.format`: none for text, any JSON object, or the JSON schema."""
    spec = body.text.format
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = ANY_OBJECT
    elif kind == "json_schema":
        if not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
            raise ValidationError(
                '`text.format` json_schema needs `name` and `schema`: {"type": '
                '"json_schema", "name": ..., "schema": {...}}'
            )
        schema = spec["schema"]  # `strict` or not, enforced: the grammar admits no other
    else:
        raise ValidationError(
            f'`text.format` type must be "text", "json_object" or "json_schema". Given: {kind!r}'
        )
    try:
        return json_schema_grammar(schema)
    except GrammarSpecError as exc:
        raise ValidationError(f"`text.format` schema: {exc}") from None


def generate_parameters(
    body: ResponsesRequest, config: RouterConfig, grammar: GrammarSpec | None
) -> GenerateParameters:
    """The canonical parameters: chat's sampling of the same values, and `grammar`."""
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ValidationError(f"`max_output_tokens` must be >= 1. Given: {body.max_output_tokens}")
    sampling = ChatCompletionRequest(
        messages=[],
        temperature=body.temperature,
        top_p=body.top_p,
        max_completion_tokens=body.max_output_tokens,
        priority=body.priority,
        timeout=body.timeout,
    )
    params = chat_parameters(sampling, config)
    return params if grammar is None else params.model_copy(update={"grammar": grammar})


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        call = _function_call(item, where)
        last = messages[-1] if messages else None
        # Consecutive calls are one assistant turn that called several functions.
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        output = item.get("output")
        text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    elif kind == "reasoning":
        pass  # earlier thinking: chat templates drop it from the prompt too
    elif kind == "item_reference":
        raise ValidationError(f"{where}: `item_reference` items are not supported ({STATELESS})")
    else:
        raise ValidationError(
            f"{where}: items of type {kind!r} are not supported: only `message`, "
            "`function_call`, `function_call_output` and `reasoning`"
        )


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ValidationError(
            f'{where}.role must be "user", "assistant", "system" or "developer". Given: {role!r}'
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": _ROLES[role], "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise ValidationError(f"{where} must be a string or a list of text parts")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"{where}: parts of type {kind!r} are not supported: only `input_text` "
                "and `output_text`"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    function = {
        "name": _string(item, "name", where),
        "arguments": _string(item, "arguments", where),
    }
    return {"id": _string(item, "call_id", where), "type": "function", "function": function}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValidationError(f"{where} needs a string `{key}`")
    return value


def _tool(index: int, tool: dict[str, Any]) -> Tool:
    where = f"`tools[{index}]`"
    if tool.get("type") != "function":
        raise ValidationError(
            f"{where}: only function tools are supported "
            f'({{"type": "function", "name": ...}}). Given: {tool.get("type")!r}'
        )
    name = _string(tool, "name", where)
    return function_tool(name, tool.get("description"), tool.get("parameters"), where)


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str):
            return name
    raise ValidationError(
        '`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": ...}'
    )
