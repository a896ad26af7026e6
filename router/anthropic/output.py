"""What a finished answer looks like in Anthropic's bodies: content blocks, stop reason, ids.

The answer's text is read as every chat API reads it (router/generation/answer.py): with
tools it is a call object, answered as one `tool_use` block (or, for the `no_tool` call,
as text); otherwise one `text` block, empty when nothing was generated. The text ends
before the stop sequence that matched, which `stop_sequence` names.
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
    ToolUseBlock,
    Usage,
)
from textgate.router.engine.channel import Finished
from textgate.router.generation.answer import read_answer
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
) -> MessageResponse:
    """The non-streamed answer of one finished request."""
    answer = read_answer(answer_text(generated.finished, options), ended=True, tools=tools)
    content: list[OutputBlock] = [
        ToolUseBlock(id=new_id("toolu"), name=call.name, input=call_input(call.arguments))
        for call in answer.calls
    ]
    if not content:
        content = [TextBlock(text=answer.content or "")]
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
