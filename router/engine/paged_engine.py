"""The paged engine loop: the scheduler plans each step, the shards run it.

One step reads::

    output = scheduler.schedule()           # which tokens, which KV blocks (pure Python)
    response = shards.step(new, plan)       # the shards compute and sample
    scheduler.update(result_of(response))   # record tokens, finish, free blocks

It serves shards that report a block size (native models over the paged KV cache);
`padded_engine.PaddedEngine` serves the padded transformers fallback. Both are `step_loop.StepLoop`s,
with the same face to the HTTP handlers: `submit` -> channels, `num_active`, `close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.batch_controller import ControllerState
from textgate.router.engine.busy_meter import BusyMeter
from textgate.router.engine.scheduler import ModelStepResult, Scheduler, SchedulerOutput
from textgate.router.engine.step_loop import Entry, ShardCall, StepLoop
from textgate.router.metrics import DECODE, PREFILL, KvCacheStats, Metrics
from textgate.router.shard_client import ShardedClient

log = logging.getLogger("textgate.router")


class PagedEngine(StepLoop):
    """Owns the scheduler; one task steps the shards while requests are in flight."""

    name = "paged-engine"

    def __init__(
        self,
        shards: ShardedClient,
        scheduler: Scheduler,
        max_concurrent_requests: int,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        """`metrics` gets the step metrics and watches the KV cache and the batch controller
        (a private one by default)."""
        super().__init__(shards, max_concurrent_requests, metrics)
        self.scheduler = scheduler
        # Utilization on every device: the share of wall time inside shard steps.
        self._busy = BusyMeter()
        # Requests the shards hold state for (preempted ones keep theirs: only KV is lost).
        self._in_shards: set[int] = set()
        self._finished_for_shards: list[int] = []
        self._metrics.watch_kv_cache(self._kv_cache_stats)
        self._metrics.watch_batch_controller(self._controller_state)

    def _enqueue(self, entry: Entry) -> None:
        request = entry.request
        try:
            self.scheduler.add_request(entry.id, request.input_ids, request.max_new_tokens)
        except ValueError as exc:
            self._fail([entry], str(exc), "validation")

    def _has_work(self) -> bool:
        # Requests that left still hold state in the shards until a step drops them.
        return self.scheduler.has_unfinished_requests() or bool(self._finished_for_shards)

    def _num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def _fail_all(self, message: str) -> None:
        self._fail(list(self._entries.values()), message)
        self._in_shards.clear()
        self._finished_for_shards = []

    async def _recover(self, exc: Exception) -> None:
        """Fail everything and start afresh: the scheduler's state is not to be trusted."""
        self._fail_all(f"Request failed during generation: {exc}")
        # What the controller learned about step costs still holds.
        self.scheduler = Scheduler(self.scheduler.config, self.scheduler.controller)
        self._went_idle()
        await self._clear_cache(None)

    async def step(self) -> None:
        """Abort cancelled requests, then plan, run and record one step."""
        started = time.monotonic()
        for entry in [e for e in self._entries.values() if e.channel.cancelled]:
            self._abort(entry)
        output = self.scheduler.schedule()
        self._finished_for_shards.extend(output.finished_ids)
        if not output.scheduled:
            self.scheduler.update(ModelStepResult())
            # The gauges turn first: the scheduler is already what they describe.
            self._report_step()
            await self._drop_finished_in_shards()
            if not self.scheduler.has_unfinished_requests():
                return
            self._wakeup.clear()
            # Nothing fits until a request leaves; wait for a cancellation or a new request.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=0.05)
            return
        # A failed step leaves the scheduler's plan unrun: everything in flight fails.
        call = ShardCall(self._method(output), fail_ids=list(self._entries))
        producing = [s.request_id for s in output.scheduled if s.produces_token]
        call_started = time.monotonic()
        result = await self._call_shards(call, self._run(output), expected_ids=producing)
        ended = time.monotonic()
        self._busy.record(call_started, ended)
        if result is None:
            self.scheduler.update(ModelStepResult())
            self._report_step()
            return
        routed = result[1]
        self.scheduler.update(
            ModelStepResult(
                sampled_token_ids=routed.sampled,
                finished_ids=frozenset(routed.finished),
                # What a running request waited for its token: planning, the shards, routing.
                step_latency_s=ended - started,
                utilization=self._busy.utilization(ended),
            )
        )
        self._report_step()

    async def _drop_finished_in_shards(self) -> None:
        """An empty step that only drops what the shards hold for requests that left."""
        if not self._finished_for_shards:
            return
        try:
            await self._shards.step([], pb.StepPlan(finished_ids=self._take_finished()))
        except Exception as exc:
            # Nothing is waiting on them; a shard that lost its way fails the next step.
            log.error("dropping finished requests from the shards failed: %s", exc)

    def _take_finished(self) -> list[int]:
        """The requests the next step tells the shards to drop; they no longer hold them."""
        finished, self._finished_for_shards = self._finished_for_shards, []
        self._in_shards.difference_update(finished)
        return finished

    async def _run(self, output: SchedulerOutput) -> pb.StepResponse:
        plan = pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=s.request_id,
                    token_ids=s.token_ids,
                    start_position=s.start_position,
                    block_table=s.block_table,
                    produces_token=s.produces_token,
                )
                for s in output.scheduled
            ],
            finished_ids=self._take_finished(),
        )
        new = [i for i in output.new_request_ids if i not in self._in_shards]
        if new:
            self._metrics.next_batch(len(new))
        now = time.monotonic()
        for request_id in new:
            self._entries[request_id].channel.started_at = now
        self._in_shards.update(new)
        requests = [self._entries[i].request.to_pb(i) for i in new]
        return await self._shards.step(requests, plan)

    def _abort(self, entry: Entry) -> None:
        """Forget a request that will not finish normally; its blocks are freed now."""
        super()._abort(entry)
        self.scheduler.abort(entry.id)
        if entry.id in self._in_shards:
            # A preempted request waits without blocks, but the shards still hold its state.
            self._finished_for_shards.append(entry.id)

    def _method(self, output: SchedulerOutput) -> str:
        """TGI's `method` label: a step computing any prompt token counts as a prefill."""
        for scheduled in output.scheduled:
            entry = self._entries.get(scheduled.request_id)
            prompt_length = entry.request.input_length if entry is not None else 0
            if scheduled.num_new_tokens > 1 or scheduled.start_position < prompt_length:
                return PREFILL
        return DECODE

    def _report_batch(self) -> None:
        """Queue and running-batch gauges; a paged batch's max tokens are its KV-cache tokens."""
        allocator = self.scheduler.allocator
        self._metrics.queue_size(self.scheduler.num_waiting)
        self._metrics.running_batch(
            self.scheduler.num_running, allocator.num_used_blocks * allocator.block_size
        )

    def _report_step(self) -> None:
        """After a step: the batch gauges, and the idle values once nothing is left."""
        if self.scheduler.has_unfinished_requests():
            self._report_batch()
        else:
            self._went_idle()

    def _went_idle(self) -> None:
        """Nothing runs or waits: utilization is 0 from now, and the gauges say so."""
        self._busy.reset()
        self.scheduler.controller.on_idle()
        self._report_batch()

    def _controller_state(self) -> ControllerState:
        return self.scheduler.controller.state()

    def _kv_cache_stats(self) -> KvCacheStats:
        allocator = self.scheduler.allocator
        return KvCacheStats(
            num_used_blocks=allocator.num_used_blocks,
            num_free_blocks=allocator.num_free_blocks,
            block_size=allocator.block_size,
            num_prefix_hit_tokens=allocator.num_prefix_hit_tokens,
            num_prefix_query_tokens=allocator.num_prefix_query_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )
