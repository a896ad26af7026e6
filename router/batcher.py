"""Continuous batching: one running batch in the shards, waiting requests join between steps.

One step reads::

    drop requests whose clients left      (FilterBatch on the running batch)
    new = queue.admit(running)            (TGI's budgets and waiting_served_ratio)
    prefill(new); decode([running, new])  (route every Generation to its channel)

Shards drop finished requests from their batches themselves; the router only
filters out the ones it cancels. A shard error fails every request of the batches
involved (with a final `ErrorEvent`) and clears them from the shards' cache. Every
admitted request ends with exactly one final event (unless its client left first).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from textgate.proto import generate_pb2 as pb
from textgate.router.channel import Channel, ErrorEvent, StepEvent
from textgate.router.config import RouterConfig
from textgate.router.metrics import DECODE, PREFILL, Metrics
from textgate.router.queue import BatchLimits, Queue, Running
from textgate.router.request import ValidRequest
from textgate.router.shard_client import ShardedClient

log = logging.getLogger("textgate.router")


class OverloadedError(Exception):
    """More requests than max_concurrent_requests; answered 429."""

    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


def batch_limits(config: RouterConfig, shard_info: pb.InfoResponse | None) -> BatchLimits:
    """The batcher's budgets from the (warmup-resolved) config."""
    return BatchLimits(
        max_batch_prefill_tokens=config.max_batch_prefill_tokens,
        max_batch_total_tokens=config.max_batch_total_tokens or config.default_batch_total_tokens(),
        max_batch_size=config.max_batch_size,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens,
        requires_padding=bool(shard_info and shard_info.requires_padding),
    )


@dataclass
class Entry:
    """A request admitted by the batcher, waiting or in a shard batch."""

    id: int
    request: ValidRequest
    channel: Channel
    released: bool = field(default=False)

    @property
    def input_length(self) -> int:
        return self.request.input_length

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens


class Batcher:
    """Owns the waiting queue and the running batch; one task steps the shards."""

    def __init__(
        self,
        shards: ShardedClient,
        limits: BatchLimits,
        max_concurrent_requests: int,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        """`metrics` gets the queue, batch and per-call metrics (a private one by default)."""
        self._shards = shards
        self._metrics = metrics or Metrics()
        self._queue: Queue[Entry] = Queue(limits)
        self._max_active = max_concurrent_requests
        self._num_active = 0
        self._running: pb.CachedBatch | None = None
        self._in_shards: dict[int, Entry] = {}
        self._steps_since_prefill = 0
        self._request_ids = itertools.count()
        self._batch_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def num_active(self) -> int:
        """Admitted requests without a final event yet."""
        return self._num_active

    def submit(self, requests: Sequence[ValidRequest]) -> list[Channel]:
        """Admit all of `requests` or none (OverloadedError); one channel each."""
        if self._closed or self._num_active + len(requests) > self._max_active:
            raise OverloadedError()
        channels = []
        for request in requests:
            entry = Entry(next(self._request_ids), request, Channel(request.input_length))
            entry.channel.on_cancel(self._wakeup.set)
            self._queue.append(entry)
            channels.append(entry.channel)
        self._num_active += len(requests)
        self._metrics.queue_size(len(self._queue))
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="textgate-batcher")
        return channels

    async def close(self) -> None:
        """Stop stepping; whatever is still admitted gets a final error event."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        leftover = [*self._queue.remove_if(lambda _: True), *self._in_shards.values()]
        self._fail(leftover, "Request failed during generation: the server is shutting down")
        self._in_shards.clear()
        self._running = None

    async def step(self) -> None:
        """One round: drop cancelled requests, admit and prefill new ones, decode all."""
        self._drop_cancelled_waiting()
        await self._filter_cancelled()
        new = self._queue.admit(self._running_view())
        if not new and self._running is None and len(self._queue):
            self._reject_head()
        self._metrics.queue_size(len(self._queue))
        batches = [self._running] if self._running is not None else []
        if new:
            cached = await self._prefill(new)
            self._steps_since_prefill = 0
            if cached is not None:
                batches.append(cached)
        self._running = await self._decode(batches) if batches else None
        if self._running is not None:
            self._steps_since_prefill += 1
        self._report_batch()

    def _report_batch(self) -> None:
        running = self._running
        self._metrics.queue_size(len(self._queue))
        if running is None:
            self._metrics.running_batch(0, 0)
        else:
            self._metrics.running_batch(running.size, running.max_tokens)

    async def _loop(self) -> None:
        while not self._closed:
            if self._running is None and not len(self._queue):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.step()
            except Exception:
                # A bug must not leave requests hanging: fail everything in flight.
                log.exception("batcher step failed")
                self._fail(list(self._in_shards.values()), "Request failed during generation")
                self._in_shards.clear()
                self._running = None
                self._report_batch()
                await self._clear_cache(None)

    def _running_view(self) -> Running | None:
        if self._running is None:
            return None
        entries = [self._in_shards[i] for i in self._running.request_ids if i in self._in_shards]
        return Running(
            size=len(entries),
            max_tokens=sum(e.request.max_tokens for e in entries),
            steps_since_prefill=self._steps_since_prefill,
        )

    def _reject_head(self) -> None:
        """The first waiting request fits no batch, even alone: refuse it, or it blocks all."""
        head = next(iter(self._queue))
        self._queue.remove_if(lambda e: e is head)
        self._fail([head], "Request does not fit in the batch token budget", "validation")

    def _drop_cancelled_waiting(self) -> None:
        for entry in self._queue.remove_if(lambda e: e.channel.cancelled):
            self._release(entry)

    async def _filter_cancelled(self) -> None:
        cancelled = [e for e in self._in_shards.values() if e.channel.cancelled]
        if not cancelled or self._running is None:
            return
        for entry in cancelled:
            del self._in_shards[entry.id]
            self._release(entry)
        batch = self._running
        keep = [i for i in batch.request_ids if i in self._in_shards]
        log.debug("filtering batch %d: %d cancelled", batch.id, len(cancelled))
        try:
            if keep:
                self._running = await self._shards.filter_batch(batch.id, keep)
            else:
                self._running = None
                await self._shards.clear_cache(batch.id)
        except Exception as exc:
            self._running = None
            self._fail_in_shards(batch.request_ids, exc)
            await self._clear_cache(batch.id)

    async def _prefill(self, entries: list[Entry]) -> pb.CachedBatch | None:
        batch = pb.Batch(
            id=next(self._batch_ids),
            requests=[e.request.to_pb(e.id) for e in entries],
            size=len(entries),
            max_tokens=sum(e.request.max_tokens for e in entries),
        )
        now = time.monotonic()
        self._metrics.next_batch(len(entries))
        for entry in entries:
            entry.channel.started_at = now
            self._in_shards[entry.id] = entry
        try:
            response = await self._shards.prefill(batch)
        except Exception as exc:
            self._metrics.batch_inference(PREFILL, time.monotonic() - now, None)
            self._fail_in_shards([e.id for e in entries], exc)
            await self._clear_cache(batch.id)
            return None
        routed = time.monotonic()
        self._metrics.batch_inference(PREFILL, routed - now, response)
        cached = response.batch if response.HasField("batch") else None
        self._route(response.generations, [e.id for e in entries], cached)
        self._metrics.batch_filtered(PREFILL, time.monotonic() - routed)
        return cached

    async def _decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        ids = [i for b in batches for i in b.request_ids]
        started = time.monotonic()
        try:
            response = await self._shards.decode(batches)
        except Exception as exc:
            self._metrics.batch_inference(DECODE, time.monotonic() - started, None)
            self._fail_in_shards(ids, exc)
            await self._clear_cache(None)
            return None
        routed = time.monotonic()
        self._metrics.batch_inference(DECODE, routed - started, response)
        cached = response.batch if response.HasField("batch") else None
        self._route(response.generations, ids, cached)
        self._metrics.batch_filtered(DECODE, time.monotonic() - routed)
        return cached

    def _route(
        self,
        generations: Iterable[pb.Generation],
        batch_ids: list[int],
        cached: pb.CachedBatch | None,
    ) -> None:
        """Send each Generation to its request; finished requests leave `_in_shards`."""
        for generation in generations:
            entry = self._in_shards.get(generation.request_id)
            if entry is None:
                continue
            event = StepEvent.from_pb(generation)
            entry.channel.push(event)
            if event.finished is not None:
                del self._in_shards[entry.id]
                self._release(entry)
        # A request the shard dropped without finishing it would otherwise wait forever.
        live = set(cached.request_ids) if cached is not None else set()
        lost = [self._in_shards[i] for i in batch_ids if i in self._in_shards and i not in live]
        for entry in lost:
            del self._in_shards[entry.id]
        self._fail(lost, "Incomplete generation", "incomplete_generation")

    def _fail_in_shards(self, request_ids: Iterable[int], exc: Exception) -> None:
        log.error("shard call failed: %s", exc)
        entries = [self._in_shards.pop(i) for i in list(request_ids) if i in self._in_shards]
        self._fail(entries, f"Request failed during generation: {exc}")

    def _fail(self, entries: Iterable[Entry], message: str, error_type: str = "generation") -> None:
        for entry in entries:
            entry.channel.push(ErrorEvent(message, error_type))
            self._release(entry)

    def _release(self, entry: Entry) -> None:
        if not entry.released:
            entry.released = True
            self._num_active -= 1

    async def _clear_cache(self, batch_id: int | None) -> None:
        try:
            await self._shards.clear_cache(batch_id)
        except Exception as exc:
            log.error("ClearCache(%s) failed: %s", batch_id, exc)
