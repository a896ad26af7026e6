"""What every loop that steps the shards shares: admission, one task, wake-up, close.

The loop reads::

    while open:
        wait until there is work     (a submit or a cancellation sets the wake-up)
        step()                       (the subclass's idea: PaddedEngine, PagedEngine)
        on a bug: recover(exc)       (fail what is in flight, so nothing hangs)

Every admitted request is an `Entry` in `_entries` until it gets its final event (or its
client leaves); `num_active` counts them against max_concurrent_requests. Subclasses say
how an entry is queued, whether there is work, what one step does, and how everything is
failed (on close, and after a bug).

Every call the loop makes to the shards (a step, a FilterBatch, the empty step that only
drops finished requests, a ClearCache) goes through `DeadlineShards`: one the shards do not
answer within `step_timeout_s` (`--shard-step-timeout`) raises `ShardTimeoutError`, so a
hung shard is reported and never waited on forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.channel import Channel, ErrorEvent, StepEvent
from textgate.router.engine.request import ValidRequest
from textgate.router.metrics import Metrics, ShardTimes
from textgate.router.shard_client import ShardedClient
from textgate.router.tracing import RequestTrace, current_request, step_span
from textgate.router.tracing import enabled as tracing_enabled

log = logging.getLogger("textgate.router")
T = TypeVar("T")

SHUTDOWN_MESSAGE = "Request failed during generation: the server is shutting down"
DEFAULT_STEP_TIMEOUT_S = 600.0
"""How long one step RPC may take before the shards count as hung (`--shard-step-timeout`)."""


class OverloadedError(Exception):
    """More requests than max_concurrent_requests; answered 429."""

    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class ShardTimeoutError(TimeoutError):
    """The shards did not answer a call within --shard-step-timeout: they count as hung."""

    def __init__(self, call: str, timeout_s: float) -> None:
        super().__init__(
            f"the shards did not answer {call} within {timeout_s:g} s (--shard-step-timeout)"
        )


class DeadlineShards:
    """The shard calls a step loop makes, each bounded by `timeout_s` (ShardTimeoutError
    past it; the call itself is cancelled)."""

    def __init__(self, shards: ShardedClient, timeout_s: float) -> None:
        self.shards = shards
        self.timeout_s = timeout_s

    async def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        return await self._within_deadline("a Prefill", self.shards.prefill(batch))

    async def decode(self, batches: Sequence[pb.CachedBatch]) -> pb.DecodeResponse:
        return await self._within_deadline("a Decode", self.shards.decode(batches))

    async def step(self, requests: Sequence[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        return await self._within_deadline("a Step", self.shards.step(requests, plan))

    async def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> pb.CachedBatch:
        call = self.shards.filter_batch(batch_id, request_ids)
        return await self._within_deadline("a FilterBatch", call)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._within_deadline("a ClearCache", self.shards.clear_cache(batch_id))

    async def _within_deadline(self, call: str, answer: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(answer, self.timeout_s)
        except asyncio.TimeoutError:
            raise ShardTimeoutError(call, self.timeout_s) from None


class ShardResponse(ShardTimes, Protocol):
    """What every step RPC answers (Prefill, Decode, Step)."""

    @property
    def generations(self) -> Sequence[pb.Generation]: ...


R = TypeVar("R", bound=ShardResponse)


@dataclass(frozen=True)
class ShardCall:
    """One call of a step to the shards, and what to do when it fails."""

    method: str
    """TGI's `method` metric label: "prefill" or "decode"."""
    fail_ids: Collection[int]
    """Requests that fail with the call (they are in the shards' batch)."""
    clear_batch_id: int | None = None
    """The batch the shards drop after a failure; None = everything."""


@dataclass
class Routed:
    """What one step produced, per request."""

    sampled: dict[int, list[int]] = field(default_factory=dict)
    """Token ids each request received this step."""
    finished: set[int] = field(default_factory=set)
    """Requests that had their final event."""


@dataclass
class Entry:
    """An admitted request: waiting, or in the shards."""

    id: int
    request: ValidRequest
    channel: Channel
    trace: RequestTrace | None = None
    """The HTTP request's span (router/tracing.py); None while tracing is off."""

    @property
    def input_length(self) -> int:
        return self.request.input_length

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens


class StepLoop(ABC):
    """Admits requests and runs one task that steps the shards while there is work."""

    name = "step-loop"
    """Names the loop's task (`textgate-<name>`) and its log lines."""

    def __init__(
        self, shards: ShardedClient, max_concurrent_requests: int, metrics: Metrics | None
    ) -> None:
        self._shards = DeadlineShards(shards, DEFAULT_STEP_TIMEOUT_S)
        self._metrics = metrics or Metrics()
        self._max_active = max_concurrent_requests
        self._entries: dict[int, Entry] = {}
        self._request_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def step_timeout_s(self) -> float:
        """A shard call not answered within this many seconds fails (a step: its requests
        with it): a hung shard is reported, not waited on forever."""
        return self._shards.timeout_s

    @step_timeout_s.setter
    def step_timeout_s(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {seconds}")
        self._shards.timeout_s = seconds

    @property
    def num_active(self) -> int:
        """Admitted requests without a final event yet."""
        return len(self._entries)

    def submit(self, requests: Sequence[ValidRequest]) -> list[Channel]:
        """Admit all of `requests` or none (OverloadedError); one channel each."""
        if self._closed or self.num_active + len(requests) > self._max_active:
            raise OverloadedError()
        channels = []
        for request in requests:
            entry = Entry(
                next(self._request_ids), request, Channel(request.input_length), current_request()
            )
            entry.channel.on_cancel(self._wakeup.set)
            self._entries[entry.id] = entry
            channels.append(entry.channel)
            self._enqueue(entry)
        self._metrics.queue_size(self._num_waiting())
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"textgate-{self.name}")
        return channels

    async def close(self) -> None:
        """Stop stepping; whatever is still admitted gets a final error event."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all(SHUTDOWN_MESSAGE)

    @abstractmethod
    async def step(self) -> None:
        """One round of work on the shards."""

    @abstractmethod
    def _enqueue(self, entry: Entry) -> None:
        """Queue a newly admitted entry (or fail it at once if it can never run)."""

    @abstractmethod
    def _has_work(self) -> bool:
        """Whether a step has anything to do; the loop sleeps until a wake-up otherwise."""

    @abstractmethod
    def _num_waiting(self) -> int:
        """Requests not yet in the shards (the queue-size gauge)."""

    @abstractmethod
    def _fail_all(self, message: str) -> None:
        """Give every admitted request an error event and forget them all."""

    @abstractmethod
    async def _recover(self, exc: Exception) -> None:
        """A step raised: fail what is in flight and reset the shards, so nothing hangs."""

    async def _loop(self) -> None:
        while not self._closed:
            if not self._has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.step()
            except Exception as exc:
                # A bug must not leave requests hanging.
                log.exception("%s step failed", self.name)
                await self._recover(exc)

    def _fail(self, entries: Iterable[Entry], message: str, error_type: str = "generation") -> None:
        """Close each entry's channel with an error event and forget it."""
        for entry in entries:
            entry.channel.push(ErrorEvent(message, error_type))
            if entry.trace is not None:
                entry.trace.failed(entry.channel, entry.input_length, message, error_type)
            self._abort(entry)

    def _abort(self, entry: Entry) -> None:
        """Forget a request that will not finish normally (subclasses free what it holds)."""
        self._release(entry)

    def _release(self, entry: Entry) -> None:
        """The request had its final event, or its client left: it no longer counts."""
        self._entries.pop(entry.id, None)

    async def _call_shards(
        self,
        call: ShardCall,
        response: Awaitable[R],
        *,
        expected_ids: Collection[int],
        running: Callable[[R], Collection[int]] | None = None,
    ) -> tuple[R, Routed] | None:
        """Await one step RPC and route its generations; on failure fail `call.fail_ids`.

        `expected_ids` are the requests the step must answer: one that the shards neither
        finished nor keep `running` (default: answered with a token) is failed as lost.
        Gives the answer and what was routed, or None when the call failed.
        """
        started = time.monotonic()
        traces = (
            [self._entries[i].trace for i in expected_ids if i in self._entries]
            if tracing_enabled()
            else []
        )
        try:
            with step_span(call.method, traces):
                answer = await response
        except Exception as exc:
            if isinstance(exc, ShardTimeoutError):
                exc = ShardTimeoutError(f"a {call.method} step", self.step_timeout_s)
            self._metrics.batch_inference(call.method, time.monotonic() - started, None)
            log.error("shard call failed: %s", exc)
            self._fail_ids(call.fail_ids, f"Request failed during generation: {exc}")
            await self._clear_cache(call.clear_batch_id)
            return None
        routed_at = time.monotonic()
        self._metrics.batch_inference(call.method, routed_at - started, answer)
        kept = None if running is None else running(answer)
        routed = self._route(answer.generations, expected_ids, kept)
        self._metrics.batch_filtered(call.method, time.monotonic() - routed_at)
        return answer, routed

    def _route(
        self,
        generations: Iterable[pb.Generation],
        expected_ids: Iterable[int],
        running: Collection[int] | None,
    ) -> Routed:
        """Send each Generation to its request; release finished ones, fail lost ones."""
        routed = Routed()
        for generation in generations:
            entry = self._entries.get(generation.request_id)
            if entry is None:
                continue
            if generation.error:
                # The shard could not serve it (a grammar it cannot compile): the
                # request's own fault, as a 422 would have been.
                self._fail([entry], generation.error, "validation")
                continue
            event = StepEvent.from_pb(generation)
            entry.channel.push(event)
            routed.sampled[entry.id] = list(generation.tokens.ids)
            if event.finished is not None:
                if entry.trace is not None:
                    entry.trace.finished(entry.channel, entry.input_length, event.finished)
                routed.finished.add(entry.id)
                self._release(entry)
        kept = routed.sampled.keys() if running is None else running
        # A request the shards dropped without finishing it would otherwise wait forever.
        lost = [i for i in expected_ids if i not in routed.finished and i not in kept]
        self._fail_ids(lost, "Incomplete generation", "incomplete_generation")
        return routed

    def _fail_ids(
        self, request_ids: Iterable[int], message: str, error_type: str = "generation"
    ) -> None:
        """`_fail` the requests among `request_ids` that are still admitted."""
        self._fail(
            [self._entries[i] for i in request_ids if i in self._entries], message, error_type
        )

    async def _clear_cache(self, batch_id: int | None = None) -> None:
        """Drop one batch (or, with None, everything) from the shards; failures are logged."""
        try:
            await self._shards.clear_cache(batch_id)
        except Exception as exc:
            log.error("ClearCache(%s) failed: %s", batch_id, exc)
