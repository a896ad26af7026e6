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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from textgate.router.engine.channel import Channel, ErrorEvent
from textgate.router.engine.request import ValidRequest
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient

log = logging.getLogger("textgate.router")

SHUTDOWN_MESSAGE = "Request failed during generation: the server is shutting down"


class OverloadedError(Exception):
    """More requests than max_concurrent_requests; answered 429."""

    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


@dataclass
class Entry:
    """An admitted request: waiting, or in the shards."""

    id: int
    request: ValidRequest
    channel: Channel

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
        self._shards = shards
        self._metrics = metrics or Metrics()
        self._max_active = max_concurrent_requests
        self._entries: dict[int, Entry] = {}
        self._request_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

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
            entry = Entry(next(self._request_ids), request, Channel(request.input_length))
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
            self._abort(entry)

    def _abort(self, entry: Entry) -> None:
        """Forget a request that will not finish normally (subclasses free what it holds)."""
        self._release(entry)

    def _release(self, entry: Entry) -> None:
        """The request had its final event, or its client left: it no longer counts."""
        self._entries.pop(entry.id, None)

    async def _clear_cache(self, batch_id: int | None = None) -> None:
        """Drop one batch (or, with None, everything) from the shards; failures are logged."""
        try:
            await self._shards.clear_cache(batch_id)
        except Exception as exc:
            log.error("ClearCache(%s) failed: %s", batch_id, exc)
