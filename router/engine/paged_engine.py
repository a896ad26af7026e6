"""The paged engine: the scheduler plans each step, the shards run it.

One step, `PagedEngine.step`, reads::

    output = scheduler.schedule()           # which tokens, which KV blocks (pure Python)
    response = shards.step(new, plan)       # the shards compute and sample
    routed = admitted.route(response)       # every token to its request's channel
    scheduler.update(routed)                # record tokens, finish, free blocks

It is the router's one engine; its face to the HTTP handlers is `submit` -> channels,
`num_active`, `close`, and it is made of an `admission.Admitted` table,
`shard_calls.ShardCalls` and a `step_task.StepTask`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.admission import Admitted, Entry, Routed
from textgate.router.engine.batch_controller import ControllerState
from textgate.router.engine.busy_meter import BusyMeter
from textgate.router.engine.channel import Channel
from textgate.router.engine.cost_meter import CostMeter, TokenWork
from textgate.router.engine.lora_registry import LoraRegistry
from textgate.router.engine.lora_residency import LoraResidency
from textgate.router.engine.request import ValidRequest
from textgate.router.engine.scheduler import ModelStepResult, Scheduler, SchedulerOutput
from textgate.router.engine.shard_calls import ShardCalls, StepFailed
from textgate.router.engine.step_task import SHUTDOWN_MESSAGE, StepTask
from textgate.router.metrics import DECODE, PREFILL, Metrics
from textgate.router.metrics_collectors import AdapterStats, KvCacheStats, KvTierStats
from textgate.router.shard_client import ShardedClient
from textgate.router.tracing import enabled as tracing_enabled

log = logging.getLogger("textgate.router")

IDLE_WAIT_S = 0.05
"""How long a step that could schedule nothing waits for a request to come or go."""

TIMEOUT_MESSAGE = "Request timed out: its deadline passed while it waited in the queue"
"""The error of a request still queued when its `timeout_s` ran out (error type `timeout`)."""


class PagedEngine:
    """Owns the scheduler; one task steps the shards while requests are in flight."""

    def __init__(
        self,
        shards: ShardedClient,
        scheduler: Scheduler,
        max_concurrent_requests: int,
        *,
        metrics: Metrics | None = None,
        adapters: LoraRegistry | None = None,
        max_loras: int = 0,
        residency: LoraResidency | None = None,
        cost: CostMeter | None = None,
    ) -> None:
        """`metrics` gets the step metrics and watches the KV cache, the batch controller and
        the adapters (a private one by default); `adapters` are the LoRA adapters the shards
        hold, at most `max_loras` resident (0: the model takes none), which ones
        `residency` decides (None: no limit); `cost` gets every served step's busy time
        and tokens (None: no cost per token)."""
        self.scheduler = scheduler
        self.residency = residency
        """Which adapters the shards hold resident; the scheduler admits by it."""
        scheduler.residency = residency
        self.adapters = adapters if adapters is not None else LoraRegistry()
        """What requests may name as `adapter_id`, and their prefix-cache salts."""
        self._metrics = metrics or Metrics()
        self._max_loras = max_loras
        self._admitted = Admitted(max_concurrent_requests)
        self.shard_calls = ShardCalls(shards, self._metrics)
        """Every call to the shards; `shard_calls.timeout_s` is --shard-step-timeout."""
        self._task = StepTask("paged-engine", self.step, self._has_work, self._recover)
        # Utilization on every device: the share of wall time inside shard steps.
        self._busy = BusyMeter()
        # Requests the shards hold state for (preempted ones keep theirs: only KV is lost).
        self._in_shards: set[int] = set()
        self._finished_for_shards: list[int] = []
        self._metrics.watch_kv_cache(self._kv_cache_stats)
        self._metrics.watch_batch_controller(self._controller_state)
        self._metrics.watch_adapters(self._adapter_stats)
        self.cost = cost
        """Cost per token (--device-hour-cost); None without a price."""
        if cost is not None:
            self._metrics.watch_cost(cost.report)

    @property
    def num_active(self) -> int:
        """Admitted requests without a final event yet."""
        return len(self._admitted)

    def submit(self, requests: Sequence[ValidRequest]) -> list[Channel]:
        """Admit all of `requests` or none (OverloadedError); one channel each."""
        entries = self._admitted.admit(requests, on_cancel=self._task.wake)
        # The first request of each prompt computes it; the copies reuse its KV.
        originals: dict[tuple[tuple[int, ...], str], int] = {}
        for entry in entries:
            request = entry.request
            try:
                # Unloaded since it was validated: refused as an unknown adapter.
                salt = self.adapters.cache_salt(request.adapter_id)
                original = originals.setdefault((tuple(request.input_ids), salt), entry.id)
                self.scheduler.add_request(
                    entry.id,
                    request.input_ids,
                    request.max_new_tokens,
                    salt,
                    copies=None if original == entry.id else original,
                    priority=request.priority,
                    tenant=request.tenant,
                    weight=request.tenant_weight,
                    adapter=request.adapter_id or "",
                )
            except ValueError as exc:
                self._admitted.fail([entry], str(exc), "validation")
                continue
            if request.adapter_id:
                self._metrics.adapter_request(request.adapter_id)
            if entry.deadline is not None:
                # At the deadline itself, not at the next step's start: a step in flight
                # (seconds, for a long prompt on a CPU) would make a queued timeout late.
                delay = max(0.0, entry.deadline - time.monotonic())
                asyncio.get_running_loop().call_later(delay, self._expire_queued, entry.id)
        self._metrics.queue_size(self.scheduler.num_waiting)
        self._task.wake()
        return [entry.channel for entry in entries]

    def num_active_on(self, adapter_id: str) -> int:
        """Admitted requests running (or waiting to run) on LoRA adapter `adapter_id`."""
        return sum(1 for entry in self._admitted if entry.request.adapter_id == adapter_id)

    async def close(self) -> None:
        """Stop stepping; whatever is still admitted gets a final error event."""
        self._admitted.closed = True
        await self._task.close()
        self._fail_all(SHUTDOWN_MESSAGE)

    async def step(self) -> None:
        """One step: schedule, run on the shards, route the tokens, update the scheduler."""
        started = time.monotonic()
        self._forget(entry for entry in self._admitted if entry.channel.cancelled)
        self._expire(started)
        output = self.scheduler.schedule()
        self._finished_for_shards.extend(output.finished_ids)
        if not output.scheduled:
            await self._idle_step()
            return
        producing = [s.request_id for s in output.scheduled if s.produces_token]
        method = self._method(output)
        # Before routing: a request that finishes in this step is released by it.
        works = self._token_works(output) if self.cost is not None else {}
        call_started = time.monotonic()
        try:
            response = await self._run(output, method, producing)
        except StepFailed as exc:
            await self._step_failed(exc, call_started)
            return
        answered = time.monotonic()
        drafts = {s.request_id: s.num_draft_tokens for s in output.scheduled if s.num_draft_tokens}
        routed = self._admitted.route(
            response.generations, expected_ids=producing, num_drafts=drafts
        )
        self._forget(routed.failed)
        self._metrics.adapter_tokens(routed.adapter_tokens)
        self._metrics.skipped_tokens(routed.skipped_tokens)
        self._report_speculation(output, routed.sampled)
        ended = time.monotonic()
        self._metrics.batch_filtered(method, ended - answered)
        self._busy.record(call_started, ended)
        if self.cost is not None:
            self._record_cost(self.cost, ended - call_started, works, routed.sampled)
        # What a running request waited for its token: planning, the shards, routing.
        self.scheduler.update(self._result(response, routed, ended - started, ended))
        self._report_step()

    async def _step_failed(self, exc: StepFailed, call_started: float) -> None:
        """The shards failed the step: everything in flight fails with it, and the shards
        are cleared."""
        self._busy.record(call_started, time.monotonic())
        if self.residency is not None:
            self.residency.resend()  # whether the shards took the last residency is unknown
        # The scheduler's plan is unrun: everything in flight fails with it.
        self._forget(self._admitted.fail(self._admitted, str(exc)))
        self.scheduler.update(ModelStepResult())
        self._forget_kv_tiers()
        # The gauges turn before the shards are cleared: their requests were answered.
        self._report_step()
        await self.shard_calls.clear_cache()

    def _result(
        self, response: pb.StepResponse, routed: Routed, latency_s: float, ended: float
    ) -> ModelStepResult:
        """The step's result for the scheduler: the routed tokens, the step's time, and the
        draft model's guesses and timing (draft-model speculation)."""
        return ModelStepResult(
            sampled_token_ids=routed.sampled,
            finished_ids=frozenset(routed.finished),
            step_latency_s=latency_s,
            utilization=self._busy.utilization(ended),
            proposed_token_ids={
                g.request_id: g.proposed_token_ids
                for g in response.generations
                if g.proposed_token_ids
            },
            draft_s=response.draft_ns / 1e9,
            draft_pass_s=response.draft_pass_ns / 1e9,
            draft_pass_rows=response.draft_pass_rows,
        )

    async def _run(
        self, output: SchedulerOutput, method: str, producing: list[int]
    ) -> pb.StepResponse:
        """Send the plan (and the requests the shards have not seen) to the shards."""
        plan = pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=s.request_id,
                    token_ids=s.token_ids,
                    start_position=s.start_position,
                    block_table=s.block_table,
                    produces_token=s.produces_token,
                    num_draft_tokens=s.num_draft_tokens,
                    num_proposed_tokens=s.num_proposed_tokens,
                )
                for s in output.scheduled
            ],
            finished_ids=self._take_finished(),
            kv_transfers=[
                pb.KvTransfer(
                    kind=f"KV_TRANSFER_KIND_{t.kind.name}",
                    block_hash=t.block_hash,
                    block_id=t.block_id,
                )
                for t in output.kv_transfers
            ],
        )
        resident = self.residency.changes() if self.residency is not None else None
        if resident is not None:
            plan.lora_residency.adapter_ids.extend(resident)
            plan.lora_residency.SetInParent()  # set, even when no adapter stays resident
        new = [i for i in output.new_request_ids if i not in self._in_shards]
        if new:
            self._metrics.next_batch(len(new))
        now = time.monotonic()
        for request_id in new:
            self._admitted[request_id].channel.started_at = now
        self._in_shards.update(new)
        requests = [self._admitted[i].request.to_pb(i) for i in new]
        traces = [self._admitted[i].trace for i in producing] if tracing_enabled() else []
        return await self.shard_calls.run(method, self.shard_calls.step(requests, plan), traces)

    async def _idle_step(self) -> None:
        """Nothing could be scheduled: drop what left from the shards, then wait a little
        for a request to come or go (nothing fits until one leaves)."""
        self.scheduler.update(ModelStepResult())
        # The gauges turn first: the scheduler is already what they describe.
        self._report_step()
        await self._drop_finished_in_shards()
        if self.scheduler.has_unfinished_requests():
            await self._task.wait_for_wake(IDLE_WAIT_S)

    def _has_work(self) -> bool:
        # Requests that left still hold state in the shards until a step drops them.
        return self.scheduler.has_unfinished_requests() or bool(self._finished_for_shards)

    def _forget(self, entries: Iterable[Entry]) -> None:
        """Free what each request (failed, or whose client left) holds: its slot, its
        blocks now, and its state in the shards with the next step."""
        for entry in list(entries):
            self._admitted.release(entry)
            self.scheduler.abort(entry.id)
            if entry.id in self._in_shards:
                # A preempted request waits without blocks, but the shards still hold it.
                self._finished_for_shards.append(entry.id)

    def _expire(self, now: float) -> None:
        """Requests past their deadline: one still queued with nothing generated fails with
        a `timeout` error and frees its slot; one that runs (or was preempted with tokens)
        ends with its next token, finish reason length (`Entry.out_of_time`)."""
        queued = []
        for entry in self._admitted:
            deadline = entry.deadline
            if deadline is None or now < deadline or entry.out_of_time:
                continue
            if self.scheduler.is_waiting(entry.id) and entry.channel.num_generated == 0:
                queued.append(entry)
            else:
                entry.out_of_time = True
        if queued:
            self._forget(self._admitted.fail(queued, TIMEOUT_MESSAGE, "timeout"))

    def _expire_queued(self, request_id: int) -> None:
        """A request's deadline timer: still queued with nothing generated, it fails now
        (`_expire` at each step's start ends the running ones). A waiting request is in no
        step in flight, so it can leave the scheduler between two steps' updates."""
        entry = self._admitted.get(request_id)
        if entry is None or entry.out_of_time or entry.channel.num_generated:
            return
        if self.scheduler.is_waiting(request_id):
            self._forget(self._admitted.fail([entry], TIMEOUT_MESSAGE, "timeout"))
            self._metrics.queue_size(self.scheduler.num_waiting)

    def _fail_all(self, message: str) -> None:
        self._admitted.fail(self._admitted, message)
        self._in_shards.clear()
        self._finished_for_shards = []

    async def _recover(self, exc: Exception) -> None:
        """A step raised: fail everything and start afresh, the scheduler's state is not
        to be trusted (what the controller learned about step costs still holds)."""
        self._fail_all(f"Request failed during generation: {exc}")
        speculator = self.scheduler.speculator
        if speculator is not None:
            speculator.clear()
        tiers = self.scheduler.allocator.kv_tiers
        if tiers is not None:
            tiers.forget_host()
        self.scheduler = Scheduler(
            self.scheduler.config, self.scheduler.controller, speculator, tiers
        )
        self.scheduler.residency = self.residency
        if self.residency is not None:
            self.residency.resend()
        self._went_idle()
        await self.shard_calls.clear_cache()

    def _forget_kv_tiers(self) -> None:
        """After a failed step, whose KV-tier transfers may or may not have run: drop the
        prefix blocks it may have restored (every request failed, so all are evictable)
        and the host tier (the shards drop theirs on ClearCache)."""
        allocator = self.scheduler.allocator
        if allocator.kv_tiers is not None:
            allocator.reset_prefix_cache()
            allocator.kv_tiers.forget_host()

    async def _drop_finished_in_shards(self) -> None:
        """An empty step that only drops what the shards hold for requests that left."""
        if not self._finished_for_shards:
            return
        try:
            await self.shard_calls.step([], pb.StepPlan(finished_ids=self._take_finished()))
        except Exception as exc:
            # Nothing is waiting on them; a shard that lost its way fails the next step.
            log.error("dropping finished requests from the shards failed: %s", exc)

    def _take_finished(self) -> list[int]:
        """The requests the next step tells the shards to drop; they no longer hold them."""
        finished, self._finished_for_shards = self._finished_for_shards, []
        self._in_shards.difference_update(finished)
        return finished

    def _method(self, output: SchedulerOutput) -> str:
        """TGI's `method` label: a step computing any prompt token counts as a prefill."""
        for scheduled in output.scheduled:
            entry = self._admitted.get(scheduled.request_id)
            prompt_length = entry.request.input_length if entry is not None else 0
            # A decode verifying drafts computes several tokens and is still a decode.
            num_known = scheduled.num_new_tokens - scheduled.num_draft_tokens
            if num_known > 1 or scheduled.start_position < prompt_length:
                return PREFILL
        return DECODE

    def _token_works(self, output: SchedulerOutput) -> dict[int, TokenWork]:
        """Each scheduled request's part of the step, for the cost meter: its known tokens
        below its prompt's length are prompt tokens; one known token past it is a decode."""
        works = {}
        for s in output.scheduled:
            entry = self._admitted.get(s.request_id)
            if entry is None:
                continue
            prompt_length = entry.request.input_length
            num_known = s.num_new_tokens - s.num_draft_tokens
            decodes = num_known == 1 and s.start_position >= prompt_length
            num_prompt = min(s.start_position + num_known, prompt_length) - s.start_position
            works[s.request_id] = TokenWork(
                tenant=entry.request.tenant,
                start_position=s.start_position,
                num_known_tokens=num_known,
                num_prompt_tokens=0 if decodes else max(0, num_prompt),
                decodes=decodes,
                num_draft_tokens=s.num_draft_tokens,
            )
        return works

    def _record_cost(
        self,
        cost: CostMeter,
        busy_s: float,
        works: Mapping[int, TokenWork],
        sampled: Mapping[int, Sequence[int]],
    ) -> None:
        """The step's busy time and tokens to `cost`, split by the fitted step cost."""
        counted = [
            dataclasses.replace(work, num_output_tokens=len(sampled.get(request_id, ())))
            for request_id, work in works.items()
        ]
        cost.record(busy_s, counted, self.scheduler.controller.cost.coefficients)

    def _report_speculation(
        self, output: SchedulerOutput, sampled: Mapping[int, Sequence[int]]
    ) -> None:
        """Drafts verified this step, accepted, and the tokens their sequences got."""
        verified = [s for s in output.scheduled if s.num_draft_tokens and s.request_id in sampled]
        if verified:
            emitted = [len(sampled[s.request_id]) for s in verified]
            self._metrics.speculative_step(
                num_drafts=sum(s.num_draft_tokens for s in verified),
                num_accepted=sum(
                    max(0, min(n - 1, s.num_draft_tokens))
                    for s, n in zip(verified, emitted, strict=True)
                ),
                num_emitted=sum(emitted),
                num_sequences=len(verified),
            )

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
            kv_tiers=self._kv_tier_stats(),
        )

    def _kv_tier_stats(self) -> KvTierStats | None:
        allocator = self.scheduler.allocator
        tiers = allocator.kv_tiers
        if tiers is None:
            return None
        hits = allocator.num_prefix_hit_tokens_by_tier
        return KvTierStats(
            hit_tokens={tier.value: count for tier, count in hits.items()},
            num_offloaded_blocks=tiers.num_offloaded_blocks,
            num_restored_blocks={t.value: n for t, n in tiers.num_restored_blocks.items()},
            num_host_blocks=tiers.num_host_used,
            num_disk_blocks=tiers.num_disk_blocks,
            block_bytes=tiers.block_bytes,
        )

    def _adapter_stats(self) -> AdapterStats:
        """Requests per adapter: running ones hold KV blocks, waiting ones do not yet."""
        running: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        for entry in self._admitted:
            adapter = entry.request.adapter_id
            if adapter and self.scheduler.has_request(entry.id):
                held = self.scheduler.allocator.has_table(entry.id)
                (running if held else waiting)[adapter] += 1
        residency = self.residency
        if residency is None:
            return AdapterStats(self._max_loras, running, waiting)
        return AdapterStats(
            self._max_loras,
            running,
            waiting,
            resident=residency.resident,
            num_loads=residency.num_loads,
            num_evictions=residency.num_evictions,
        )
