"""What a finished answer looks like in Anthropic's bodies: content blocks, stop reason, ids.

The answer's text is read as every chat API reads it: with --reasoning-parser its
thinking first (router/generation/reasoning.py), a `thinking` block; then the answer
(router/generation/answer.py): with tools a call object, answered as one `tool_use` block
(or, for the `no_tool` call, as text); otherwise one `text` block, empty only when there
is no other block. The text ends before the stop sequence that matched, which
`stop_sequence` names.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from textgate.router.anthropic.schemas import (
    MessageResponse,
    OutputBlock,
    StopDelta,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from textgate.router.engine.channel import Finished
from textgate.router.generation.answer import read_answer
from textgate.router.generation.reasoning import ReasoningParser, read_reasoning
from textgate.router.generation.result import Generated
from textgate.router.generation.stop_text import TextOptions, answer_text, matched_stop

_STOP_REASONS: dict[str, StopReason] = {
    "eos_token": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
}


def new_id(prefix: str) -> str:
    """A fresh id in Anthropic's style: `msg_…`, `toolu_…`."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_delta(finished: Finished, options: TextOptions, called: bool) -> StopDelta:
    """Why the answer ended: a call that completed is "tool_use"; a stop sequence is named."""
    reason = _STOP_REASONS[finished.finish_reason]
    if called and reason == "end_turn":
        return StopDelta(stop_reason="tool_use")
    if reason != "stop_sequence":
        return StopDelta(stop_reason=reason)
    return StopDelta(stop_reason=reason, stop_sequence=matched_stop(finished.text, options.stop))


def call_input(arguments: str) -> dict[str, Any]:
    """A call's `input` object; {} when its text is not one (a call cut by max_tokens)."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def message_response(
    message_id: str,
    model: str,
    generated: Generated,
    options: TextOptions,
    *,
    tools: bool,
    reasoning: ReasoningParser | None = None,
) -> MessageResponse:
    """The non-streamed answer of one finished request."""
    text = answer_text(generated.finished, options)
    reasoned = read_reasoning(text, ended=True, parser=reasoning)
    content: list[OutputBlock] = []
    if reasoned.reasoning is not None:
        content.append(ThinkingBlock(thinking=reasoned.reasoning))
    answer = read_answer(reasoned.rest, ended=True, tools=tools)
    content += [
        ToolUseBlock(id=new_id("toolu"), name=call.name, input=call_input(call.arguments))
        for call in answer.calls
    ]
    if not answer.calls and (answer.content or not content):
        content.append(TextBlock(text=answer.content or ""))
    stop = stop_delta(generated.finished, options, called=bool(answer.calls))
    return MessageResponse(
        id=message_id,
        model=model,
        content=content,
        stop_reason=stop.stop_reason,
        stop_sequence=stop.stop_sequence,
        usage=Usage(
            input_tokens=generated.input_length,
            output_tokens=generated.finished.generated_tokens,
        ),
    )
