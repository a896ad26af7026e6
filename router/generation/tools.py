"""Tools for any chat API: the call object's grammar, the tools prompt, earlier calls as text.

Tool calls are generated as one JSON object, `{"name": "<function>", "arguments":
{...}}`, constrained by a JSON schema grammar: the name is one of the tools' and the
arguments match that tool's `parameters` schema, so they always parse.

- "required" (OpenAI; Anthropic's "any"): any of the tools; a named tool: that one only.
- "auto" (the default with tools): the grammar also admits the function `no_tool`
  with `{"content": "<answer>"}` (TGI's approach); a `no_tool` call is answered as a
  plain assistant message with that content. Free text beside calls is not admitted:
  a grammar choosing between "any text" and "a call" would leave a small model free
  to ramble past the call format.
- "none": the tools are ignored, the answer is free text (the API says so: no plan).

The prompt: a chat template that knows tools (its source reads `tools`) gets them as
`apply_chat_template(tools=...)`, in its own format; other templates get a system
message listing the tools and the answer format. Earlier assistant tool calls and
`tool` results (in the messages chat templates read, OpenAI's shape) go to a tools
template as they are, and to the others as text. How a generated call object is read
back is router/generation/answer.py; each API parses its own `tools` into `Tool`s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from textgate.router.engine.request import GrammarSpec
from textgate.router.generation.grammar import GrammarSpecError, json_schema_grammar
from textgate.router.generation.validation import ValidationError

NO_TOOL = "no_tool"
"""The function an "auto" answer calls to answer in text instead."""
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What a tool's name may be (OpenAI's and Anthropic's rule)."""
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The arguments schema of a tool that declares none."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI spells it (what chat templates read)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request with tools is prompted, constrained and read back."""

    tools: tuple[Tool, ...]
    """The tools shown to the model."""
    grammar: GrammarSpec
    """The call object's grammar."""
    auto: bool
    """`no_tool` is allowed: the model may answer in text."""


def check_tool_name(name: str, where: str) -> None:
    """ValidationError unless `name` (the field `where`) is a valid tool name."""
    if not TOOL_NAME.fullmatch(name):
        raise ValidationError(f"{where} must be 1 to 64 letters, digits, _ or -. Given: {name!r}")


def function_tool(name: str, description: Any, parameters: Any, where: str) -> Tool:
    """The tool an API's fields describe (`where` names them in errors): a valid name,
    and a JSON schema object for the arguments (none given: no arguments)."""
    check_tool_name(name, f"{where}.name")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValidationError(f"{where}.parameters must be a JSON schema object")
    return Tool(name=name, description=str(description or ""), parameters=parameters)


def check_tools(tools: Sequence[Tool]) -> None:
    """ValidationError unless the tools' names are unique and not reserved."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValidationError("`tools` names must be unique")
    if NO_TOOL in names:
        raise ValidationError(f"`{NO_TOOL}` is a reserved tool name")


def plan_tools(
    tools: tuple[Tool, ...], *, auto: bool, name: str | None = None, field: str = "tool_choice"
) -> ToolPlan:
    """The plan that calls one of `tools` (`name`: that one only); `auto` also lets the
    model answer in text. The tools must have passed `check_tools`."""
    chosen = tools
    if name is not None:
        chosen = tuple(t for t in tools if t.name == name)
        if not chosen:
            raise ValidationError(f"`{field}` names `{name}`, which is not in `tools`")
    calls = [_call_schema(t.name, t.parameters) for t in chosen]
    if auto:
        calls.append(_call_schema(NO_TOOL, _NO_TOOL_PARAMETERS))
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        grammar = json_schema_grammar(schema)
    except GrammarSpecError as exc:
        raise ValidationError(f"`tools` parameters: {exc}") from None
    return ToolPlan(tools=chosen if not auto else tools, grammar=grammar, auto=auto)


def template_reads_tools(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template renders `tools` (its own tool format)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tool_messages(
    messages: list[dict[str, Any]], plan: ToolPlan, template_tools: bool
) -> list[dict[str, Any]]:
    """The messages to render: for a template without tools, the tools and the answer
    format go in a system message and earlier tool calls become text."""
    if template_tools:
        return messages
    rendered = [_as_text(m) for m in messages]
    prompt = _tools_prompt(plan)
    if rendered and rendered[0].get("role") == "system":
        first = rendered[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *rendered[1:]]
    return [{"role": "system", "content": prompt}, *rendered]


_NO_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"content": {"type": "string", "description": "Your answer to the user."}},
    "required": ["content"],
}


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
    }


def _tools_prompt(plan: ToolPlan) -> str:
    tools = json.dumps([t.as_openai()["function"] for t in plan.tools], indent=1)
    lines = [
        "You can call these functions (`parameters` is the JSON schema of `arguments`):",
        tools,
        'To call one, answer with only a JSON object: {"name": <function name>, '
        '"arguments": {<argument>: <value>, ...}}.',
    ]
    if plan.auto:
        lines.append(
            f'When no function fits, answer {{"name": "{NO_TOOL}", "arguments": '
            '{"content": <your answer>}}.'
        )
    return "\n".join(lines)


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a template without tools renders it: calls and results as text."""
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        text = "\n".join(json.dumps(_call_text(c)) for c in _sequence(calls))
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        return {**rest, "content": text}
    if message.get("role") == "tool":
        return {"role": "tool", "content": message.get("content") or ""}
    return message


def _call_text(call: Any) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    return {"name": function.get("name"), "arguments": parsed}


def _sequence(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []
