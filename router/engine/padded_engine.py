"""Continuous batching: one running batch in the shards, waiting requests join between steps.

One step reads::

    drop requests whose clients left      (FilterBatch on the running batch)
    new = queue.admit(running)            (TGI's budgets and waiting_served_ratio)
    prefill(new); decode([running, new])  (route every Generation to its channel)

Shards drop finished requests from their batches themselves; the router only
filters out the ones it cancels. A shard error fails every request of the batches
involved (with a final `ErrorEvent`) and clears them from the shards' cache. Every
admitted request ends with exactly one final event (unless its client left first).
Admission, the shard calls and the loop task are the parts `paged_engine.PagedEngine` is
made of too (`admission`, `shard_calls`, `step_task`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.admission import Admitted, Entry
from textgate.router.engine.channel import Channel
from textgate.router.engine.padded_queue import BatchLimits, Queue, Running
from textgate.router.engine.request import ValidRequest
from textgate.router.engine.shard_calls import ShardCalls, StepFailed
from textgate.router.engine.step_task import SHUTDOWN_MESSAGE, StepTask
from textgate.router.metrics import DECODE, PREFILL, Metrics
from textgate.router.shard_client import ShardedClient
from textgate.router.tracing import enabled as tracing_enabled

log = logging.getLogger("textgate.router")


class PaddedEngine:
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
        self._metrics = metrics or Metrics()
        self._admitted = Admitted(max_concurrent_requests)
        self.shard_calls = ShardCalls(shards, self._metrics)
        """Every call to the shards; `shard_calls.timeout_s` is --shard-step-timeout."""
        self._task = StepTask("padded-engine", self.step, self._has_work, self._recover)
        self._queue: Queue[Entry] = Queue(limits)
        self._running: pb.CachedBatch | None = None
        self._in_shards: set[int] = set()
        self._steps_since_prefill = 0
        self._batch_ids = itertools.count()

    @property
    def num_active(self) -> int:
        """Admitted requests without a final event yet."""
        return len(self._admitted)

    def submit(self, requests: Sequence[ValidRequest]) -> list[Channel]:
        """Admit all of `requests` or none (OverloadedError); one channel each."""
        entries = self._admitted.admit(requests, on_cancel=self._task.wake)
        for entry in entries:
            self._queue.append(entry)
        self._metrics.queue_size(len(self._queue))
        self._task.wake()
        return [entry.channel for entry in entries]

    async def close(self) -> None:
        """Stop stepping; whatever is still admitted gets a final error event."""
        self._admitted.closed = True
        await self._task.close()
        self._queue.remove_if(lambda _: True)
        self._admitted.fail(self._admitted, SHUTDOWN_MESSAGE)
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

    def _has_work(self) -> bool:
        return self._running is not None or bool(len(self._queue))

    def _forget(self, entries: Iterable[Entry]) -> None:
        """The requests are done with (finished, failed, or their client left)."""
        for entry in list(entries):
            self._admitted.release(entry)
            self._in_shards.discard(entry.id)

    async def _recover(self, exc: Exception) -> None:
        """Fail the requests in the shards; waiting ones stay queued for the next step."""
        self._forget(self._admitted.fail_ids(self._in_shards, "Request failed during generation"))
        self._in_shards.clear()
        self._running = None
        self._report_batch()
        await self.shard_calls.clear_cache(None)

    def _running_view(self) -> Running | None:
        if self._running is None:
            return None
        entries = [self._admitted[i] for i in self._running.request_ids if i in self._in_shards]
        return Running(
            size=len(entries),
            max_tokens=sum(e.request.max_tokens for e in entries),
            steps_since_prefill=self._steps_since_prefill,
        )

    def _reject_head(self) -> None:
        """The first waiting request fits no batch, even alone: refuse it, or it blocks all."""
        head = next(iter(self._queue))
        self._queue.remove_if(lambda e: e is head)
        self._admitted.fail([head], "Request does not fit in the batch token budget", "validation")

    def _drop_cancelled_waiting(self) -> None:
        self._forget(self._queue.remove_if(lambda e: e.channel.cancelled))

    async def _filter_cancelled(self) -> None:
        cancelled = [
            self._admitted[i] for i in self._in_shards if self._admitted[i].channel.cancelled
        ]
        if not cancelled or self._running is None:
            return
        self._forget(cancelled)
        batch = self._running
        keep = [i for i in batch.request_ids if i in self._in_shards]
        log.debug("filtering batch %d: %d cancelled", batch.id, len(cancelled))
        try:
            if keep:
                self._running = await self.shard_calls.filter_batch(batch.id, keep)
            else:
                self._running = None
                await self.shard_calls.clear_cache(batch.id)
        except Exception as exc:
            self._running = None
            log.error("shard call failed: %s", exc)
            message = f"Request failed during generation: {exc}"
            self._forget(self._admitted.fail_ids(batch.request_ids, message))
            await self.shard_calls.clear_cache(batch.id)

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
        return await self._step_batch(PREFILL, ids, self.shard_calls.prefill(batch), batch.id)

    async def _decode(self, batches: list[pb.CachedBatch]) -> pb.CachedBatch | None:
        ids = [i for b in batches for i in b.request_ids]
        return await self._step_batch(DECODE, ids, self.shard_calls.decode(batches), None)

    async def _step_batch(
        self,
        method: str,
        ids: list[int],
        call: Awaitable[pb.PrefillResponse | pb.DecodeResponse],
        clear_batch_id: int | None,
    ) -> pb.CachedBatch | None:
        """Run a Prefill or Decode of the requests `ids` and route its tokens; the batch the
        shards keep (None: none left, or the call failed: then its requests failed too, and
        the shards drop `clear_batch_id`, or everything with None)."""
        traces = [self._admitted.get(i) for i in ids] if tracing_enabled() else []
        try:
            response = await self.shard_calls.run(
                method, call, [e.trace for e in traces if e is not None]
            )
        except StepFailed as exc:
            self._forget(self._admitted.fail_ids(ids, str(exc)))
            await self.shard_calls.clear_cache(clear_batch_id)
            return None
        routed_at = time.monotonic()
        kept = set(response.batch.request_ids) if response.HasField("batch") else set()
        routed = self._admitted.route(response.generations, expected_ids=ids, running=kept)
        self._in_shards.difference_update(routed.finished)
        self._forget(routed.failed)
        self._metrics.batch_filtered(method, time.monotonic() - routed_at)
        return response.batch if response.HasField("batch") else None
