"""A streamed OpenAI response: typed server-sent events, each `event: <type>` then its
JSON with `type` and `sequence_number`.

    response.created, response.in_progress
    per output item, as soon as the text says what it is:
      response.output_item.added
      thinking:   response.content_part.added, response.reasoning_text.delta …,
                  response.reasoning_text.done, response.content_part.done
      a message:  response.content_part.added, response.output_text.delta …,
                  response.output_text.done, response.content_part.done
      a call:     response.function_call_arguments.delta …,
                  response.function_call_arguments.done
      response.output_item.done
    response.completed (or response.incomplete, cut by max_output_tokens)

The thinking (with --reasoning-parser) is complete, and its item done, as soon as the
answer begins; the other items end with the response. A failure sends `error` then
`response.failed`. The deltas are the differences between successive readings of the
text so far (router/generation/reasoning.py, then router/generation/answer.py), and the last
response is built from the items they add up to, so the streamed answer is the
non-streamed one (router/openai/responses_output.py) event by event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from textgate.router.engine.channel import ErrorEvent, StepEvent
from textgate.router.generation.answer import AnswerDiff, CallDelta
from textgate.router.generation.reasoning import ReasoningDiff, ReasoningParser, thinking_tokens
from textgate.router.generation.result import TextLedger, visible_text
from textgate.router.http.sse import sse_frame
from textgate.router.openai.responses_output import (
    ResponseHead,
    call_item,
    message_item,
    new_id,
    reasoning_item,
    response_usage,
    status_of,
)
from textgate.router.openai.responses_schemas import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorStreamEvent,
    ItemStatus,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningText,
    ResponseError,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)


@dataclass
class _Item:
    """An output item being streamed: a message's text, a call's arguments or the
    thinking so far."""

    id: str
    output_index: int
    kind: Literal["message", "call", "reasoning"]
    text: str = ""
    """The message's text, the call's arguments, or the thinking."""
    call_id: str = ""
    """A call's."""
    name: str = ""
    status: ItemStatus | None = None
    """Set once the item is done."""

    def as_output(self, status: ItemStatus) -> OutputItem:
        status = self.status or status
        if self.kind == "message":
            return message_item(self.id, self.text, status)
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        return call_item(self.id, self.call_id, self.name, self.text, status)


class ResponseEvents:
    """The frames of one streamed response, from its channel's events.

    `opening` first, `step` for each (joined) step event, `closing` once the channel
    ended (`failure` set when it failed).
    """

    def __init__(
        self,
        head: ResponseHead,
        input_tokens: int,
        *,
        tools: bool,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self._head = head
        self._input_tokens = input_tokens
        self._ledger = TextLedger()
        self._reasoning = reasoning
        self._thinking = ReasoningDiff(reasoning)
        self._pieces: list[str] = []
        """Each token's visible text, to count the thinking's tokens."""
        self._answer = AnswerDiff(tools)
        self._items: list[_Item] = []
        self._thought: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}
        """Open calls by their index in the answer."""
        self._status: ItemStatus = "in_progress"
        self._sequence_number = 0

    def opening(self) -> bytes:
        created = LifecycleEvent(
            type="response.created", response=self._head.response("in_progress")
        )
        progress = LifecycleEvent(
            type="response.in_progress", response=self._head.response("in_progress")
        )
        return self._frames([created, progress])

    def step(self, index: int, event: StepEvent) -> bytes:
        event = self._ledger.settle(event)
        done = event.finished
        self._pieces += [visible_text([token]) for token in event.tokens]
        thinking, rest = self._thinking.push(visible_text(event.tokens), done is not None)
        content, calls = self._answer.push(rest, done is not None)
        events: list[StreamEvent] = []
        if thinking:
            events += self._add_thinking(thinking)
        if rest and self._thought is not None and self._thought.status is None:
            events += self._close(self._thought, "completed")
        if content:
            events += self._add_text(content)
        for call in calls:
            events += self._add_call(call)
        if done is not None:
            if not self._items:
                events += self._open_message()  # an empty answer is an empty message
            status = status_of(done.finish_reason)
            events += [
                e for item in self._items if item.status is None for e in self._close(item, status)
            ]
            self._status = status
        return self._frames(events)

    def closing(self, failure: ErrorEvent | None, output_tokens: int) -> bytes:
        """The last events: the response completed (or incomplete), or failed."""
        if failure is None:
            output = [item.as_output(self._status) for item in self._items]
            thought = thinking_tokens(self._pieces, self._reasoning)
            usage = response_usage(self._input_tokens, output_tokens, thought)
            kind = "response.completed" if self._status == "completed" else "response.incomplete"
            response = self._head.response(self._status, output, usage)
            return self._frames([LifecycleEvent(type=kind, response=response)])
        output = [item.as_output("incomplete") for item in self._items]
        error = ResponseError(code="server_error", message=failure.message)
        failed = self._head.response("failed", output, error=error)
        return self._frames(
            [
                ErrorStreamEvent(code=failure.error_type, message=failure.message),
                LifecycleEvent(type="response.failed", response=failed),
            ]
        )

    def _add_text(self, content: str) -> list[StreamEvent]:
        events = self._open_message() if self._message is None else []
        message = self._message
        assert message is not None
        message.text += content
        events.append(
            TextDeltaEvent(item_id=message.id, output_index=message.output_index, delta=content)
        )
        return events

    def _open_message(self) -> list[StreamEvent]:
        message = self._message = self._open(new_id("msg"), "message")
        return [self._added(message), self._part_added(message, OutputText(text=""))]

    def _add_thinking(self, thinking: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._thought is None:
            self._thought = self._open(new_id("rs"), "reasoning")
            events += [
                self._added(self._thought),
                self._part_added(self._thought, ReasoningText(text="")),
            ]
        thought = self._thought
        thought.text += thinking
        events.append(
            ReasoningDeltaEvent(
                item_id=thought.id, output_index=thought.output_index, delta=thinking
            )
        )
        return events

    def _part_added(self, item: _Item, part: OutputText | ReasoningText) -> ContentPartEvent:
        return ContentPartEvent(
            type="response.content_part.added",
            item_id=item.id,
            output_index=item.output_index,
            part=part,
        )

    def _add_call(self, delta: CallDelta) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.name is not None:
            call = self._open(new_id("fc"), "call", call_id=new_id("call"), name=delta.name)
            self._calls[delta.index] = call
            events.append(self._added(call))
        call = self._calls[delta.index]
        if delta.arguments:
            call.text += delta.arguments
            events.append(
                ArgumentsDeltaEvent(
                    item_id=call.id, output_index=call.output_index, delta=delta.arguments
                )
            )
        return events

    def _open(
        self,
        item_id: str,
        kind: Literal["message", "call", "reasoning"],
        call_id: str = "",
        name: str = "",
    ) -> _Item:
        item = _Item(item_id, len(self._items), kind, call_id=call_id, name=name)
        self._items.append(item)
        return item

    def _added(self, item: _Item) -> OutputItemEvent:
        return OutputItemEvent(
            type="response.output_item.added",
            output_index=item.output_index,
            item=item.as_output("in_progress"),
        )

    def _close(self, item: _Item, status: ItemStatus) -> list[StreamEvent]:
        item_id, index = item.id, item.output_index
        item.status = status
        events: list[StreamEvent]
        if item.kind != "call":
            part: OutputText | ReasoningText
            if item.kind == "message":
                part = OutputText(text=item.text)
                text: StreamEvent = TextDoneEvent(
                    item_id=item_id, output_index=index, text=item.text
                )
            else:
                part = ReasoningText(text=item.text)
                text = ReasoningDoneEvent(item_id=item_id, output_index=index, text=item.text)
            events = [
                text,
                ContentPartEvent(
                    type="response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    part=part,
                ),
            ]
        else:
            events = [
                ArgumentsDoneEvent(
                    item_id=item_id, output_index=index, name=item.name, arguments=item.text
                )
            ]
        done = OutputItemEvent(
            type="response.output_item.done",
            output_index=item.output_index,
            item=item.as_output(status),
        )
        return [*events, done]

    def _frames(self, events: list[StreamEvent]) -> bytes:
        frames = []
        for event in events:
            event.sequence_number = self._sequence_number
            self._sequence_number += 1
            frames.append(sse_frame(event, event.type))
        return b"".join(frames)
