"""One request's events, from the engine to the HTTP handler that answers it.

The engine pushes a `StepEvent` per Generation the shards return for the request;
the last event is either a `StepEvent` with `finished` set or an `ErrorEvent`.
The handler iterates the channel and cancels it when its client goes away.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from textgate.proto import generate_pb2 as pb
from textgate.router.tgi.schemas import FinishReason

FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}


@dataclass(frozen=True)
class TokenInfo:
    """A token with its logprob (None where the model gives none) and text."""

    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass(frozen=True)
class Finished:
    """How a request ended (the shard's GeneratedText)."""

    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None


@dataclass(frozen=True)
class StepEvent:
    """What one step produced for one request."""

    tokens: list[TokenInfo]
    top_tokens: list[list[TokenInfo]] = field(default_factory=list)
    """Alternatives for each of `tokens` (when top_n_tokens > 0)."""
    prefill: list[TokenInfo] = field(default_factory=list)
    """Prompt tokens with logprobs (prefill step, when asked for)."""
    finished: Finished | None = None

    @classmethod
    def from_pb(cls, generation: pb.Generation) -> StepEvent:
        finished = None
        if generation.HasField("generated_text"):
            done = generation.generated_text
            finished = Finished(
                text=done.text,
                generated_tokens=done.generated_tokens,
                finish_reason=FINISH_REASONS.get(done.finish_reason, "length"),
                seed=done.seed if done.HasField("seed") else None,
            )
        return cls(
            tokens=tokens_from_pb(generation.tokens),
            top_tokens=[tokens_from_pb(t) for t in generation.top_tokens],
            prefill=tokens_from_pb(generation.prefill_tokens),
            finished=finished,
        )


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed; `error_type` is TGI's (generation, incomplete_generation, ...)."""

    message: str
    error_type: str = "generation"


Event = StepEvent | ErrorEvent


def tokens_from_pb(tokens: pb.Tokens) -> list[TokenInfo]:
    """Tokens from the proto; missing logprobs/texts/flags (a terse shard) read as unknown."""
    logprobs, texts, specials = tokens.logprobs, tokens.texts, tokens.is_special
    result = []
    for i, token_id in enumerate(tokens.ids):
        logprob = logprobs[i] if i < len(logprobs) else math.nan
        result.append(
            TokenInfo(
                id=token_id,
                text=texts[i] if i < len(texts) else "",
                # The first prompt token has no logprob: the shard sends NaN, TGI shows null.
                logprob=None if math.isnan(logprob) else logprob,
                special=specials[i] if i < len(specials) else False,
            )
        )
    return result


class Channel:
    """An unbounded event queue for one request, plus its cancellation flag and timings."""

    def __init__(self, input_length: int) -> None:
        self.input_length = input_length
        self.queued_at = time.monotonic()
        """When the request was admitted."""
        self.started_at: float | None = None
        """When its first prefill was sent."""
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = False
        self._closed = False
        self._on_cancel: Callable[[], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def closed(self) -> bool:
        """A final event was pushed."""
        return self._closed

    def push(self, event: Event) -> None:
        """Deliver an event; finished steps and errors close the channel."""
        if self._closed:
            return
        self._closed = isinstance(event, ErrorEvent) or event.finished is not None
        self._events.put_nowait(event)

    def cancel(self) -> None:
        """The client went away: the engine drops the request at its next step."""
        if self._closed or self._cancelled:
            return
        self._cancelled = True
        if self._on_cancel is not None:
            self._on_cancel()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        self._on_cancel = callback

    async def __aiter__(self) -> AsyncIterator[Event]:
        """Events until (and including) the final one."""
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, ErrorEvent) or event.finished is not None:
                return
