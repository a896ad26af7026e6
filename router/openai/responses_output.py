"""What a generated sequence looks like as an OpenAI response object: output items,
status, usage.

The text is read as chat reads it: with --reasoning-parser its thinking first
(router/generation/reasoning.py), a `reasoning` item; then the answer
(router/generation/answer.py), a message item with one `output_text` part, or with tools
a `function_call` item per call (a `no_tool` answer is a message). A message with no text
is only made when there is no other item. A sequence cut by its token limit is `incomplete`
(`incomplete_details.reason` "max_output_tokens"), its items too; streamed or not, a
response is built by `ResponseHead.response` from the same reading.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from textgate.router.engine.channel import FinishReason
from textgate.router.generation.answer import read_answer
from textgate.router.generation.reasoning import ReasoningParser, read_reasoning, thinking_tokens
from textgate.router.generation.result import Generated, visible_text
from textgate.router.openai.responses_schemas import (
    FunctionCall,
    IncompleteDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's style: "resp_…", "msg_…", "fc_…", "call_…"."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseHead:
    """What every state of one response repeats: its id, creation time, model, and the
    request fields it echoes."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest

    @classmethod
    def new(cls, model: str, request: ResponsesRequest) -> ResponseHead:
        return cls(id=new_id("resp"), created_at=int(time.time()), model=model, request=request)

    def response(
        self,
        status: ResponseStatus,
        output: Sequence[OutputItem] = (),
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        """The response object in `status`."""
        body = self.request
        incomplete = IncompleteDetails(reason="max_output_tokens")
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            error=error,
            incomplete_details=incomplete if status == "incomplete" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=list(output),
            parallel_tool_calls=body.parallel_tool_calls,
            temperature=body.temperature,
            top_p=body.top_p,
            text=body.text,
            tool_choice=body.tool_choice,
            tools=body.tools,
            usage=usage,
            metadata=body.metadata or {},
            user=body.user,
        )


def status_of(reason: FinishReason) -> ItemStatus:
    """A finished sequence's status: cut by its token limit is "incomplete"."""
    return "incomplete" if reason == "length" else "completed"


def response_usage(
    input_tokens: int, output_tokens: int, reasoning_tokens: int = 0
) -> ResponseUsage:
    """Token counts of a response; `reasoning_tokens` of the output ones were thinking."""
    return ResponseUsage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=input_tokens + output_tokens,
    )


def thinking_status(answered: bool, status: ItemStatus) -> ItemStatus:
    """A reasoning item's status: completed once the answer began, else the response's."""
    return "completed" if answered else status


def reasoning_item(item_id: str, text: str, status: ItemStatus) -> ReasoningItem:
    """The thinking, as one `reasoning_text` part."""
    return ReasoningItem(id=item_id, status=status, content=[ReasoningText(text=text)])


def message_item(item_id: str, text: str, status: ItemStatus) -> OutputMessage:
    """An assistant message with one text part."""
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: ItemStatus
) -> FunctionCall:
    """A function call item."""
    return FunctionCall(id=item_id, call_id=call_id, name=name, arguments=arguments, status=status)


def completed_response(
    head: ResponseHead,
    generated: Generated,
    input_tokens: int,
    tools: bool,
    reasoning: ReasoningParser | None = None,
) -> ResponseObject:
    """The non-streamed response of a finished sequence; with `tools` its text is a call
    object, read back into `function_call` items; with `reasoning` its thinking is a
    `reasoning` item before them."""
    finished = generated.finished
    status = status_of(finished.finish_reason)
    reasoned = read_reasoning(finished.text, ended=True, parser=reasoning)
    output: list[OutputItem] = []
    if reasoned.reasoning is not None:
        thinking = thinking_status(bool(reasoned.rest), status)
        output.append(reasoning_item(new_id("rs"), reasoned.reasoning, thinking))
    answer = read_answer(reasoned.rest, ended=True, tools=tools)
    output += [
        call_item(new_id("fc"), new_id("call"), call.name, call.arguments, status)
        for call in answer.calls
    ]
    # A text answer (with tools: a `no_tool` call); an empty one only as the sole item.
    if answer.content or (answer.content is not None and not output):
        output.append(message_item(new_id("msg"), answer.content, status))
    pieces = [visible_text([token]) for token in generated.tokens]
    usage = response_usage(
        input_tokens, finished.generated_tokens, thinking_tokens(pieces, reasoning)
    )
    return head.response(status, output, usage)
