"""A chat choice's text as OpenAI's message and stream deltas (`content`, `tool_calls`).

The reading of the text is router/generation/answer.py's, the same for every API; this
spells it OpenAI's way: a call's first delta has its `index`, `id`, `type`, name and the
arguments known so far, the next ones what the arguments add.
"""

from __future__ import annotations

from typing import Any

from textgate.router.generation.answer import AnswerDiff, read_answer
from textgate.router.generation.reasoning import ReasoningDiff, ReasoningParser, read_reasoning
from textgate.router.openai.schemas import AssistantMessage
from textgate.router.openai.tools import new_call


def answer_message(
    text: str, tools: bool, reasoning: ReasoningParser | None = None
) -> AssistantMessage:
    """The non-streamed message of a finished choice's text: its thinking apart (with a
    reasoning parser), then its content or tool calls."""
    reasoned = read_reasoning(text, ended=True, parser=reasoning)
    answer = read_answer(reasoned.rest, ended=True, tools=tools)
    calls = [new_call(call.name, call.arguments) for call in answer.calls]
    return AssistantMessage(
        content=answer.content, tool_calls=calls or None, reasoning_content=reasoned.reasoning
    )


class AnswerStream:
    """A streamed choice: the thinking, content and tool-call deltas each new piece of
    text adds (one entry per call and chunk)."""

    def __init__(self, tools: bool, reasoning: ReasoningParser | None = None) -> None:
        self._reasoning = ReasoningDiff(reasoning)
        self._diff = AnswerDiff(tools)
        self.thinking = ""
        """What the last `push` added to the thinking."""

    @property
    def called(self) -> bool:
        """The answer is a tool call (the finish reason is then "tool_calls")."""
        return self._diff.called

    def push(self, text: str, ended: bool) -> tuple[str, list[dict[str, Any]]]:
        """Add `text`; the content and the tool-call deltas to send now (the thinking's
        in `thinking`)."""
        self.thinking, rest = self._reasoning.push(text, ended)
        content, calls = self._diff.push(rest, ended)
        deltas: list[dict[str, Any]] = []
        for call in calls:
            if call.name is not None:
                opened = new_call(call.name, call.arguments).model_dump(mode="json")
                deltas.append({"index": call.index, **opened})
            else:
                deltas.append({"index": call.index, "function": {"arguments": call.arguments}})
        return content, deltas
