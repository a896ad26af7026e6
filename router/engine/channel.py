"""One request's events, from the engine to the HTTP handler that answers it.

The engine pushes a `StepEvent` per Generation the shards return for the request;
the last event is either a `StepEvent` with `finished` set or an `ErrorEvent`.
The handler takes the events (one at a time, or all that arrived since it last
looked) and cancels the channel when its client goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from textgate.proto import generate_pb2 as pb

FinishReason = Literal["length", "eos_token", "stop_sequence"]
"""Why a request stopped, in TGI's words (the engine's own vocabulary; APIs map it)."""

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
    prefill_top: list[list[TokenInfo]] = field(default_factory=list)
    """Each prompt token's top-n alternatives, when top_n_tokens was asked for too (the
    first prompt token has none)."""
    finished: Finished | None = None

    @classmethod
    def from_pb(cls, generation: pb.Generation, skip_special_tokens: bool = True) -> StepEvent:
        """The event of one Generation; without `skip_special_tokens` every token counts as
        text (its `special` flag off), so the special ones' text shows where text is built."""
        finished = None
        if generation.HasField("generated_text"):
            done = generation.generated_text
            finished = Finished(
                text=done.text,
                generated_tokens=done.generated_tokens,
                finish_reason=FINISH_REASONS.get(done.finish_reason, "length"),
                seed=done.seed if done.HasField("seed") else None,
            )
        tokens = tokens_from_pb(generation.tokens)
        if not skip_special_tokens:
            tokens = [dataclasses.replace(t, special=False) for t in tokens]
        return cls(
            tokens=tokens,
            top_tokens=[tokens_from_pb(t) for t in generation.top_tokens],
            prefill=tokens_from_pb(generation.prefill_tokens),
            prefill_top=[tokens_from_pb(t) for t in generation.prefill_top_tokens],
            finished=finished,
        )

    def split(self, num_tokens: int) -> tuple[StepEvent, StepEvent]:
        """The event's first `num_tokens` tokens (with its prompt tokens) and the rest (with
        its end), each an event of its own; 0 < `num_tokens` < len(tokens)."""
        if not 0 < num_tokens < len(self.tokens):
            raise ValueError(f"cannot split {len(self.tokens)} tokens at {num_tokens}")
        head = StepEvent(
            tokens=self.tokens[:num_tokens],
            top_tokens=self.top_tokens[:num_tokens],
            prefill=self.prefill,
            prefill_top=self.prefill_top,
        )
        rest = StepEvent(
            tokens=self.tokens[num_tokens:],
            top_tokens=self.top_tokens[num_tokens:],
            finished=self.finished,
        )
        return head, rest

    @classmethod
    def joined(cls, events: Sequence[StepEvent]) -> StepEvent:
        """One event carrying the steps of `events` in order, ending as the last one does."""
        if len(events) == 1:
            return events[0]
        return cls(
            tokens=[t for e in events for t in e.tokens],
            top_tokens=[top for e in events for top in e.top_tokens],
            prefill=[t for e in events for t in e.prefill],
            prefill_top=[top for e in events for top in e.prefill_top],
            finished=events[-1].finished,
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


@dataclass(frozen=True)
class Arrival:
    """When a pushed event came, and how many tokens its step brought (an event split by
    `Channel.take` keeps its step's arrival)."""

    at: float
    num_step_tokens: int


NUM_STEP_GAPS = 4
"""Gaps between a request's last steps that `Channel.step_interval` is the median of."""

STREAM_BUFFER_OVERFLOW = "stream_buffer_overflow"
"""The `error_type` of a stream cancelled because its client left too many tokens unread."""


def is_final(event: Event) -> bool:
    """Whether `event` is the last one of its request."""
    return isinstance(event, ErrorEvent) or event.finished is not None


class Channel:
    """One request's events, its cancellation flag and its timings.

    The engine pushes without ever waiting (`push` is synchronous), so no reader can slow
    the step loop. The reader takes whatever has arrived in one go (`take`), which is how
    a stream whose client reads slower than tokens come coalesces them into one write.
    What waits unread can be bounded (`bound`): past the bound the unread tokens are
    dropped, the request is cancelled, and an error event is all that is left to read.
    """

    def __init__(self, input_length: int, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` gives the monotonic seconds the channel's timings are in."""
        self.input_length = input_length
        self._clock = clock
        self.queued_at = clock()
        """When the request was admitted."""
        self.started_at: float | None = None
        """When its first prefill was sent."""
        self.first_token_at: float | None = None
        """When its first generated token arrived from the shards."""
        self.num_generated = 0
        """Tokens the shards generated for it so far (those dropped by an overflow too)."""
        self.num_token_events = 0
        """Steps that brought it tokens (fewer than its tokens where speculation's drafts
        were accepted)."""
        self.num_draft_tokens = 0
        """Speculation's drafts the shards verified for it."""
        self.num_accepted_tokens = 0
        """Of those, the ones accepted (each a token it got without a step of its own)."""
        self._events: deque[Event] = deque()
        self._arrivals: deque[Arrival] = deque()
        """Beside each event of `_events`: when its step came."""
        self._step_gaps: deque[float] = deque(maxlen=NUM_STEP_GAPS)
        self._last_step_at: float | None = None
        self._num_pending_tokens = 0
        self._max_pending_tokens: int | None = None
        self._on_overflow: Callable[[], None] | None = None
        self._arrived = asyncio.Event()
        self._cancelled = False
        self._closed = False
        self._on_cancel: Callable[[], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def closed(self) -> bool:
        """A final event was pushed (or the channel overflowed)."""
        return self._closed

    @property
    def num_skipped_tokens(self) -> int:
        """Tokens beyond one per step that brought any (TGI's skipped tokens)."""
        return self.num_generated - self.num_token_events

    @property
    def num_pending_tokens(self) -> int:
        """Tokens pushed and not taken yet."""
        return self._num_pending_tokens

    @property
    def has_pending(self) -> bool:
        """Some event waits to be taken."""
        return bool(self._events)

    @property
    def final_pending(self) -> bool:
        """The request's last event waits to be taken."""
        return bool(self._events) and is_final(self._events[-1])

    @property
    def newest_pending(self) -> tuple[Event, Arrival] | None:
        """The last event waiting to be taken (what is left of it) and when its step came."""
        if not self._events:
            return None
        return self._events[-1], self._arrivals[-1]

    @property
    def step_interval(self) -> float | None:
        """Seconds between the request's steps lately (the median of the gaps between its
        last token-bearing steps); None before its second such step."""
        if not self._step_gaps:
            return None
        return statistics.median(self._step_gaps)

    def verified(self, num_drafts: int, num_emitted: int) -> None:
        """A step verified `num_drafts` drafts for the request and gave it `num_emitted`
        tokens: the accepted drafts, then the step's own token (fewer where the request
        ended inside the accepted run)."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += max(0, min(num_emitted - 1, num_drafts))

    def bound(self, max_pending_tokens: int, on_overflow: Callable[[], None] | None = None) -> None:
        """Cancel the request when more than `max_pending_tokens` tokens would wait untaken,
        and call `on_overflow` then (the reader may not look for a long time).

        A final event is always accepted: the request costs nothing more once it ended.
        """
        if max_pending_tokens < 1:
            raise ValueError(f"max_pending_tokens must be at least 1, got {max_pending_tokens}")
        self._max_pending_tokens = max_pending_tokens
        self._on_overflow = on_overflow

    def listen(self, arrived: asyncio.Event) -> None:
        """Set `arrived` whenever an event is pushed (one event can watch several channels)."""
        self._arrived = arrived
        if self._events:
            arrived.set()

    def push(self, event: Event) -> None:
        """Deliver an event; finished steps and errors close the channel. Never waits."""
        if self._closed:
            return
        final = is_final(event)
        num_tokens = 0 if isinstance(event, ErrorEvent) else len(event.tokens)
        now = self._clock()
        if num_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
            if self._last_step_at is not None:
                self._step_gaps.append(now - self._last_step_at)
            self._last_step_at = now
        self.num_generated += num_tokens
        self.num_token_events += num_tokens > 0
        limit = self._max_pending_tokens
        if not final and limit is not None and self._num_pending_tokens + num_tokens > limit:
            self._overflow(limit)
            return
        self._closed = final
        self._events.append(event)
        self._arrivals.append(Arrival(now, num_tokens))
        self._num_pending_tokens += num_tokens
        self._arrived.set()

    def take(self, max_tokens: int | None = None, split: bool = False) -> list[Event]:
        """The events waiting, oldest first: all of them, or whole events up to `max_tokens`
        tokens (at least one event when any waits). With `split`, exactly `max_tokens`
        tokens where that many wait: the event that would pass the bound gives its first
        tokens (`StepEvent.split`) and the rest of it stays first in line."""
        taken: list[Event] = []
        num_tokens = 0
        while self._events:
            event = self._events[0]
            size = 0 if isinstance(event, ErrorEvent) else len(event.tokens)
            if max_tokens is not None and num_tokens + size > max_tokens:
                room = max_tokens - num_tokens
                if split and room > 0 and isinstance(event, StepEvent):
                    head, self._events[0] = event.split(room)
                    taken.append(head)
                    num_tokens += room
                    break
                if taken:
                    break
            taken.append(self._events.popleft())
            self._arrivals.popleft()
            num_tokens += size
        self._num_pending_tokens -= num_tokens
        return taken

    async def wait(self) -> None:
        """Until some event waits to be taken."""
        while not self._events:
            self._arrived.clear()
            await self._arrived.wait()

    def cancel(self) -> bool:
        """The client went away: the engine drops the request at its next step.

        Gives whether this cancelled anything (False once the request ended or was
        already cancelled).
        """
        if self._closed or self._cancelled:
            return False
        self._cancelled = True
        if self._on_cancel is not None:
            self._on_cancel()
        return True

    def on_cancel(self, callback: Callable[[], None]) -> None:
        self._on_cancel = callback

    async def __aiter__(self) -> AsyncIterator[Event]:
        """Events until (and including) the final one."""
        while True:
            await self.wait()
            for event in self.take():
                yield event
                if is_final(event):
                    return

    def _overflow(self, limit: int) -> None:
        """Too much waits unread: drop it, cancel the request, leave only the error to read."""
        unread = self._num_pending_tokens
        self._events.clear()
        self._arrivals.clear()
        self._num_pending_tokens = 0
        self.cancel()
        self._closed = True
        message = (
            f"Stream buffer overflow: the client left more than {limit} tokens unread, "
            f"so the request was cancelled ({unread} unread tokens dropped)"
        )
        self._events.append(ErrorEvent(message, STREAM_BUFFER_OVERFLOW))
        self._arrivals.append(Arrival(self._clock(), 0))
        self._arrived.set()
        if self._on_overflow is not None:
            self._on_overflow()
