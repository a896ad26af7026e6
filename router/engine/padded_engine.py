"""Continuous batching: one running batch in the shards, waiting requests join between steps.

One step reads::

    drop requests whose clients left      (FilterBatch on the running batch)
    new = queue.admit(running)            (TGI's budgets and waiting_served_ratio)
    prefill(new); decode([running, new])  (route every Generation to its channel)

Shards drop finished requests from their batches themselves; the router only
filters out the ones it cancels. A shard error fails every request of the batches
involved (with a final `ErrorEvent`) and clears them from the shards' cache. Every
admitted request ends with exactly one final event (unless its client left first).
Admission, the loop task and close are `step_loop.StepLoop`'s; this module is the step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.padded_queue import BatchLimits, Queue, Running
from textgate.router.engine.step_loop import Entry, ShardCall, StepLoop
from textgate.router.metrics import DECODE, PREFILL, Metrics
from textgate.router.shard_client import ShardedClient

log = logging.getLogger("textgate.router")


class PaddedEngine(StepLoop):
    """Owns the waiting queue and the running batch; one task steps the shards."""

    name = "padded-engine"

    def __init__(
        self,
        shards: ShardedClient,
        limits: BatchLimits,
        max_concurrent_requests: int,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        """`metrics` gets the queue, batch and per-call metrics (a private one by default)."""
        super().__init__(shards, max_concurrent_requests, metrics)
        self._queue: Queue[Entry] = Queue(limits)
        self._running: pb.CachedBatch | None = None
        self._in_shards: set[int] = set()
        self._steps_since_prefill = 0
        self._batch_ids = itertools.count()

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

    def _enqueue(self, entry: Entry) -> None:
        self._queue.append(entry)

    def _has_work(self) -> bool:
        return self._running is not None or bool(len(self._queue))

    def _num_waiting(self) -> int:
        return len(self._queue)

    def _release(self, entry: Entry) -> None:
        super()._release(entry)
        self._in_shards.discard(entry.id)

    def _fail_all(self, message: str) -> None:
        self._queue.remove_if(lambda _: True)
        self._fail(list(self._entries.values()), message)
        self._in_shards.clear()
        self._running = None

    async def _recover(self, exc: Exception) -> None:
        """Fail the requests in the shards; waiting ones stay queued for the next step."""
        self._fail_ids(self._in_shards, "Request failed during generation")
        self._in_shards.clear()
        self._running = None
        self._report_batch()
        await self._clear_cache(None)

    def _running_view(self) -> Running | None:
        if self._running is None:
            return None
        entries = [self._entries[i] for i in self._running.request_ids if i in self._in_shards]
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
        cancelled = [
            self._entries[i] for i in self._in_shards if self._entries[i].channel.cancelled
        ]
        if not cancelled or self._running is None:
            return
        for entry in cancelled:
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
            log.error("shard call failed: %s", exc)
            self._fail_ids(batch.request_ids, f"Request failed during generation: {exc}")
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
            self._in_shards.add(entry.id)
        ids = [e.id for e in entries]
        call = ShardCall(PREFILL, fail_ids=ids, clear_batch_id=batch.id)
        return await self._step_batch(call, self._shards.prefill(batch))

    async def _decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        ids = [i for b in batches for i in b.request_ids]
        return await self._step_batch(ShardCall(DECODE, fail_ids=ids), self._shards.decode(batches))

    async def _step_batch(
        self, call: ShardCall, response: Awaitable[pb.PrefillResponse | pb.DecodeResponse]
    ) -> pb.CachedBatch | None:
        """Run a Prefill or Decode; the batch the shards keep (None: none left, or failed)."""
        result = await self._call_shards(
            call, response, expected_ids=call.fail_ids, running=_cached_ids
        )
        if result is None or not result[0].HasField("batch"):
            return None
        return result[0].batch


def _cached_ids(response: pb.PrefillResponse | pb.DecodeResponse) -> set[int]:
    """Requests the shards keep in the batch they cached after the step."""
    return set(response.batch.request_ids) if response.HasField("batch") else set()
