"""Step scheduler: decides, before every forward pass, which tokens of which requests run.

One rule covers prefill, chunked prefill, decode, prefix-cache hits and recompute
after preemption: every request's `num_computed_tokens` catches up with its
`num_tokens` (prompt + generated so far) under a per-step token budget. A step that
brings a request's computed tokens up to its total samples its next token.

Copies of one prompt (OpenAI's `n`, a batch repeating a prompt) share its prefill: a
copy waits at the head of the queue while the request it copies is running and still
computing that prompt, then joins on a prefix-cache hit of the prompt's full blocks
(`add_request`'s `copies`).

The waiting queue is ordered by `priority` (lower first) and is first come, first served
within one priority: a request joins behind every waiting one of its priority or better,
and a preempted one goes back ahead of every waiting one of its priority. A request of a
better priority than some running one, at the head of the queue and unable to join (the
batch limit is reached, or its blocks are not free), preempts the newest running request
of the worst priority, as many as it needs (`_make_way`): recompute, so the preempted one
resumes with its tokens kept and greedy output unchanged.

Within the best waiting priority class, tenants share fairly (`fairness`, the Virtual
Token Counter): the next request is the first of the backlogged tenant whose weighted
service so far is smallest, first come first served inside a tenant. Preempted requests
still go first within their priority, and the head of this order is never overtaken: when
it does not fit, nobody joins. With one tenant (or none: every request is anonymous) the
order is the queue's.

A tenant below its share of the running batch (its running requests against its weight's
share among the tenants running or waiting) has its new requests' prompts run in a step of
their own, before the step with the decodes, rather than beside them (`_step_of_its_own`):
a light tenant's first token then waits for one prompt-sized step, not for a step of
another tenant's twenty decodes as well. The decodes wait that step (bounded by the
inter-token target, and never two such steps in a row); with one tenant it never happens.

The engine step reads in three lines::

    output = scheduler.schedule()      # data only: what to compute, where the KV goes
    result = run_on_shards(output)     # the shards compute and sample
    scheduler.update(result)           # record tokens, finish, free blocks

How much a step computes is the `batch_controller.BatchController`'s call: with
`SchedulerConfig.adaptive` it chooses the prompt tokens beside each step's decodes and how
many requests may run from measured step times (fed back through `update`); without, the
budgets are fixed at their maxima.

The config and the step's input and output types live in `step_types`.

Pure Python: no torch, no I/O, no asyncio. Not thread-safe; one task drives it, and
`abort` is called from that same task between steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from textgate.router.engine.batch_controller import BatchController, StepSample
from textgate.router.engine.block_allocator import BlockAllocator
from textgate.router.engine.fairness import ANONYMOUS_TENANT, VirtualCounters
from textgate.router.engine.first_token import Backlog
from textgate.router.engine.kv_tiers import KvTierIndex
from textgate.router.engine.lora_residency import LoraGate, LoraResidency
from textgate.router.engine.speculation import Candidate, Speculator
from textgate.router.engine.step_cost import attention_pairs
from textgate.router.engine.step_types import (
    ModelStepResult,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)
from textgate.router.engine.waiting_queue import WaitingQueue


@dataclass
class _Request:
    """A request's scheduling state; its tokens are prompt + generated so far."""

    request_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    num_computed_tokens: int = 0
    added_at_s: float = 0.0
    """When it was added, on the controller's clock (`BatchController.clock_s`)."""
    cache_salt: str = ""
    """What else its KV depends on besides its tokens (the LoRA adapter): prefix-cache
    hits only come from requests with the same salt."""
    copies: int | None = None
    """The request whose prompt (and salt) this one repeats, if any."""
    adapter: str = ""
    """The LoRA adapter it runs on ("" the base): it runs only while that one is resident."""
    priority: int = 0
    """Lower is admitted first (vLLM's `priority`)."""
    tenant: str = ANONYMOUS_TENANT
    """Whose fair share it is served from."""
    preempted: bool = False
    """It ran and was preempted (it goes first within its priority)."""
    num_prompt_charged: int = 0
    """Prompt tokens already added to its tenant's counter (a recompute is not charged
    twice, a prefix-cache hit not at all)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_output_tokens > 0 and self.num_tokens - self.num_computed_tokens == 1


@dataclass
class _StepDraft:
    """The step being planned inside one `schedule()` call."""

    budget: int
    """Tokens the step may still take (it shrinks as they are added)."""
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Speculation: the drafts proposed for this step's decodes, by request."""
    scheduled: dict[int, ScheduledRequest] = field(default_factory=dict)
    new_request_ids: list[int] = field(default_factory=list)
    preempted_ids: list[int] = field(default_factory=list)
    token_budget: int = field(init=False)
    """What `budget` was at the start: the step's token budget."""

    def __post_init__(self) -> None:
        self.token_budget = self.budget


class Scheduler:
    """Owns the waiting queue and the running batch and plans every step.

    `add_request` and `abort` may be called at any time between steps; each
    `schedule()` that scheduled work must be followed by one `update()` with the
    shards' result before the next `schedule()`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        controller: BatchController | None = None,
        speculator: Speculator | None = None,
        kv_tiers: KvTierIndex | None = None,
    ):
        """`controller` and `speculator` carry learned ones over (a scheduler rebuilt after
        a failure); `kv_tiers` is the host and disk KV tiers' index (None: evicted prefix
        blocks are dropped), kept over a rebuilt scheduler too."""
        self.config = config
        self.residency: LoraResidency | None = None
        """Which LoRA adapters the shards hold (`--max-loras`; the engine sets it and keeps it
        over a rebuilt scheduler): admission makes a request's resident first, or the
        request waits for a slot. None: no limit."""
        self.allocator = BlockAllocator(
            config.num_blocks, config.block_size, config.enable_prefix_caching, kv_tiers
        )
        self.controller = controller or BatchController(config.controller_config())
        self.fairness = VirtualCounters()
        """Each tenant's virtual token counter (who is admitted next)."""
        self._requests: dict[int, _Request] = {}
        self._waiting: WaitingQueue[_Request] = WaitingQueue(self.fairness)
        # Admission order: the last one is the first to be preempted.
        self._running: list[_Request] = []
        self._finished_ids: list[int] = []
        self._in_flight: tuple[ScheduledRequest, ...] | None = None
        # (decodes, prompt tokens, prompt attention pairs) of the step in flight, for the
        # controller.
        self._in_flight_counts: tuple[int, int, float] = (0, 0, 0.0)
        self._num_steps_without_join = 0
        self._own_step_last = False
        """The last step was a step of their own for tenants below their share."""
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        """Of those, the preemptions for a waiting request of a better priority."""
        self.speculator = speculator
        """N-gram speculation's proposals and acceptance rates; None = off."""
        if speculator is None and config.speculation is not None:
            self.speculator = Speculator(config.speculation)

    # ---- queries ----

    @property
    def token_budget(self) -> int:
        """Tokens the next step may compute (its decodes, then the prefill share)."""
        return self._step_budget(self._num_decoding(), self.controller.prefill_budget)

    @property
    def batch_limit(self) -> int:
        """Most running requests before waiting ones stop joining (the controller's limit)."""
        return min(self.controller.batch_limit, self.config.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (new or preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def has_request(self, request_id: int) -> bool:
        """Whether the request is waiting or running (not finished, not aborted)."""
        return request_id in self._requests

    def is_waiting(self, request_id: int) -> bool:
        """Whether the request is in the waiting queue (new, or preempted)."""
        request = self._requests.get(request_id)
        return request is not None and request not in self._running

    def output_token_ids(self, request_id: int) -> tuple[int, ...]:
        """Tokens generated so far for a live request."""
        request = self._requests[request_id]
        return tuple(request.token_ids[request.num_prompt_tokens :])

    # ---- requests in and out ----

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        cache_salt: str = "",
        copies: int | None = None,
        priority: int = 0,
        tenant: str = ANONYMOUS_TENANT,
        weight: float = 1.0,
        adapter: str = "",
    ) -> None:
        """Queue a request; ValueError if it is malformed or could never fit the KV cache.

        `copies`: an earlier request with the same prompt and salt, whose prefill this one
        waits for and then reuses through the prefix cache. `priority`: lower joins the
        queue ahead (behind every waiting request of the same priority or better).
        `tenant`, `weight`: whose fair share serves it, and that tenant's weight (> 0).
        `adapter`: the LoRA adapter it runs on ("" the base)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already scheduled")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id} has an empty prompt")
        if max_new_tokens < 1:
            raise ValueError(
                f"request {request_id}: max_new_tokens must be at least 1, got {max_new_tokens}"
            )
        total = len(prompt_token_ids) + max_new_tokens
        if weight <= 0:
            raise ValueError(f"request {request_id}: weight must be > 0, got {weight}")
        if total > self.config.max_num_cached_tokens:
            raise ValueError(
                f"request {request_id} needs {total} tokens of KV cache (prompt "
                f"{len(prompt_token_ids)} + max_new_tokens {max_new_tokens}) but the whole "
                f"cache holds {self.config.max_num_cached_tokens}"
            )
        request = _Request(
            request_id,
            list(prompt_token_ids),
            len(prompt_token_ids),
            max_new_tokens,
            added_at_s=self.controller.clock_s,
            cache_salt=cache_salt,
            copies=copies,
            priority=priority,
            tenant=tenant,
            adapter=adapter,
        )
        self._requests[request_id] = request
        self.fairness.arrive(tenant, weight)
        self._waiting.add(request)

    def abort(self, request_id: int) -> bool:
        """Drop a request (client went away) and free its blocks now; False if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if self.speculator is not None:
            self.speculator.drop(request_id)
        if request in self._running:
            self._running.remove(request)
            self.allocator.free(request_id)
            self._finished_ids.append(request_id)
        else:
            self._waiting.remove(request)
        return True

    # ---- the step ----

    def schedule(self) -> SchedulerOutput:
        """Plan the next step.

        Running requests first (their decodes, then the one unfinished prefill), then
        waiting requests in admission order (priority, preempted first, then the tenant
        furthest behind its fair share, then arrival) as the budget and free blocks allow.
        """
        if self._in_flight:
            raise RuntimeError("schedule() called again before update() of the previous step")
        if not self._requests:
            self.controller.on_idle()
        draft = self._step_of_its_own()
        self._own_step_last = draft is not None
        if draft is None:
            budget = self._step_budget(self._num_decoding(), self.controller.plan_prefill)
            drafts = self._plan_drafts()
            num_drafts = sum(len(tokens) for tokens in drafts.values())
            budget = min(self.config.max_num_batched_tokens, budget + num_drafts)
            draft = _StepDraft(budget=budget, drafts=drafts)
            self._make_way(draft)
            made_way = len(draft.preempted_ids)
            self._schedule_running(draft)
            # Admitting while running requests are short of blocks would only preempt more.
            if len(draft.preempted_ids) == made_way:
                self._schedule_waiting(draft)
        if self.speculator is not None and self.speculator.config.draft_model:
            self._ask_for_guesses(draft)
        if draft.new_request_ids or not self._waiting:
            self._num_steps_without_join = 0
        else:
            self._num_steps_without_join += 1
        output = SchedulerOutput(
            scheduled=tuple(draft.scheduled.values()),
            new_request_ids=tuple(draft.new_request_ids),
            preempted_ids=tuple(draft.preempted_ids),
            finished_ids=tuple(self._finished_ids),
            token_budget=draft.token_budget,
            kv_transfers=tiers.take_transfers() if (tiers := self.allocator.kv_tiers) else (),
        )
        self._finished_ids.clear()
        self._in_flight = output.scheduled
        decoding = [s for s in output.scheduled if self._requests[s.request_id].is_decoding]
        chunks = [s for s in output.scheduled if not self._requests[s.request_id].is_decoding]
        # Drafts cost what prompt tokens do: a few tokens' queries over the context.
        self._in_flight_counts = (
            len(decoding),
            output.num_scheduled_tokens - len(decoding),
            sum(attention_pairs(s.start_position, s.num_new_tokens) for s in chunks)
            + sum(attention_pairs(s.start_position + 1, s.num_draft_tokens) for s in decoding),
        )
        return output

    def update(self, result: ModelStepResult) -> tuple[int, ...]:
        """Record the shards' result for the last scheduled step; return who finished.

        Advances each scheduled request's computed tokens, appends sampled tokens,
        finishes requests (stopping criteria, or max_new_tokens as a safety net), frees
        their blocks and publishes newly computed full blocks to the prefix cache.
        Raises ValueError, changing nothing, if the result does not match the step.
        """
        if self._in_flight is None:
            raise RuntimeError("update() called without a scheduled step")
        live = [s for s in self._in_flight if s.request_id in self._requests]
        self._check_result(live, result)
        self._in_flight = None
        num_finished_before = len(self._finished_ids)
        for step in live:
            self._advance(self._requests[step.request_id], step, result)
        if result.draft_pass_s and self.speculator is not None:
            self.speculator.draft_passes.add(result.draft_pass_rows, result.draft_pass_s)
        if result.step_latency_s is not None:
            num_decodes, num_prefill_tokens, prefill_attention = self._in_flight_counts
            self.controller.observe(
                StepSample(
                    num_decodes=num_decodes,
                    num_prefill_tokens=num_prefill_tokens,
                    prefill_attention=prefill_attention,
                    # The target's step: the draft model's guessing is costed on its own.
                    latency_s=result.step_latency_s - result.draft_s,
                    num_running=len(self._running),
                    num_waiting=len(self._waiting),
                    kv_usage=self.allocator.usage,
                    utilization=result.utilization,
                )
            )
        return tuple(self._finished_ids[num_finished_before:])

    # ---- internals ----

    def _num_decoding(self) -> int:
        return sum(1 for request in self._running if request.is_decoding)

    def _step_budget(
        self, num_decodes: int, prefill_budget: Callable[[int, int, Backlog | None], int]
    ) -> int:
        """Fixed: max_num_batched_tokens. Adaptive: every decode, plus the controller's
        prefill share beside them (for a chunk at the position the step's first prompt
        tokens start, and the prompt work waiting), within max_num_batched_tokens."""
        ceiling = self.config.max_num_batched_tokens
        if not self.config.adaptive:
            return ceiling
        prefilling = self._prefilling()
        context = prefilling.num_computed_tokens if prefilling is not None else 0
        share = prefill_budget(num_decodes, context, self._backlog(prefilling))
        return min(ceiling, num_decodes + share)

    def _prefilling(self) -> _Request | None:
        """The running request still in its prefill (at most one, the newest): the next
        prompt chunk continues it; without one a new prompt starts at position 0."""
        for request in reversed(self._running):
            if not request.is_decoding and request.num_computed_tokens < request.num_tokens:
                return request
        return None

    def _backlog(self, prefilling: _Request | None) -> Backlog | None:
        """The prompts the prefill share could serve, in the order it serves them, with
        their requests' ages, for the controller's TTFT target (None when none waits): the
        unfinished prefill, then the head of the queue and as many more as the batch limit
        has free slots for (the others wait for a slot, which no prefill share gives)."""
        slots = max(1, self.batch_limit - len(self._running))
        pending = [prefilling] if prefilling is not None else []
        pending += [r for _, r in zip(range(slots), self._waiting, strict=False)]
        if not pending:
            return None
        now = self.controller.clock_s
        return Backlog(
            tuple(
                (r.request_id, r.num_tokens - r.num_computed_tokens, now - r.added_at_s)
                for r in pending
            )
        )

    def _make_way(self, draft: _StepDraft) -> None:
        """Preempt for the head of the queue when a running request has a worse priority and
        the head cannot join otherwise: no seat below the batch limit, or fewer free blocks
        than its tokens need (prefix hits not counted). The victims are the newest running
        requests of the worst priority, one at a time until the head fits; none of a
        priority as good as the head's is ever preempted. A head on a LoRA adapter, or a
        copy waiting for its original's prefill, does not preempt (a seat would not be
        what it waits for)."""
        if not self._waiting or not self._running:
            return
        head = next(iter(self._waiting))
        if head.adapter or self._awaits_prompt(head):
            return
        size = self.config.block_size
        tokens = min(head.num_tokens + self.config.num_reserved_tokens, head.max_total_tokens)
        needed = -(-tokens // size)
        while self._running:
            seated = len(self._running) < self.batch_limit
            if seated and self.allocator.num_free_blocks >= needed:
                return
            worst = max(request.priority for request in self._running)
            if worst <= head.priority:
                return
            victim = next(r for r in reversed(self._running) if r.priority == worst)
            self._preempt(victim, draft)
            self.num_priority_preemptions += 1

    def _schedule_running(self, draft: _StepDraft) -> None:
        """Give every running request its next tokens, oldest first.

        Admission order is decode-first order: a request starts its prefill only with
        the budget left after all older requests were served, and a chunk is cut short
        only when it uses up the budget, so at most one running request is still in its
        prefill and it is the newest. Every decode fits: a fixed budget is at least
        max_num_seqs, an adaptive one is the step's decodes plus the prefill share.
        """
        index = 0
        # Preemption pops from the end, so the list shrinks under the loop.
        while index < len(self._running) and draft.budget > 0:
            request = self._running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, draft.budget)
            if not self._make_room(request, num_new, draft):
                return  # it preempted itself, so everything newer is gone too
            self._add_to_step(request, num_new, draft, self._room_for_drafts(request, draft))
            index += 1

    def _make_room(self, request: _Request, num_new: int, draft: _StepDraft) -> bool:
        """Grow the request's table for this step, preempting the newest requests as needed.

        False when the request itself had to be preempted. Never fails otherwise: a
        lone request always fits, because add_request rejects any that could not.
        """
        while not self.allocator.grow(request.request_id, request.num_computed_tokens + num_new):
            victim = self._running[-1]
            self._preempt(victim, draft)
            if victim is request:
                return False
        return True

    def _preempt(self, request: _Request, draft: _StepDraft) -> None:
        """Recompute policy: free all blocks, requeue at the head with the generated tokens
        kept, so the recompute is a prefill of prompt + output (often a prefix-cache hit)."""
        # The newest request is never one already scheduled in this step: those are older.
        assert request.request_id not in draft.scheduled
        self._running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed_tokens = 0
        request.preempted = True
        self._waiting.readd(request)
        draft.preempted_ids.append(request.request_id)
        self.num_preemptions += 1

    def _step_of_its_own(self) -> _StepDraft | None:
        """A step of only the new prompts of tenants below their share of the running batch
        (see the module docstring), or None for the usual step: none waits, the decodes ran
        without one last step, one tenant, fixed budgets, or nothing of theirs fits."""
        if self._own_step_last or not self._waiting:
            return None
        if not any(request.is_decoding for request in self._running):
            return None
        running = Counter(request.tenant for request in self._running)
        below = self.fairness.below_share(running)
        if not below or below >= running.keys():  # no decodes of others to go before
            return None
        budget = self.controller.step_of_its_own()
        if budget <= 0:
            return None
        draft = _StepDraft(budget=budget)
        best = next(iter(self._waiting)).priority  # the queue is in priority order
        self._schedule_waiting(draft, only=(below, best))
        return draft if draft.new_request_ids else None

    def _schedule_waiting(
        self, draft: _StepDraft, only: tuple[set[str], int] | None = None
    ) -> None:
        """Admit in admission order (`WaitingQueue.next`) while budget, blocks and the batch
        limit allow.

        The max-waiting rule: once nobody joined for max_waiting_steps steps, the head
        joins past the batch limit (one request; max_num_seqs and blocks still hold).
        A request whose LoRA adapter gets no slot waits, passed over (`lora_residency`).
        `only` (tenants, priority): admit only these tenants' new requests of that priority
        (a step of their own), the others passed over.
        """
        reserve = self.config.num_reserved_tokens
        overdue = self._num_steps_without_join >= self.config.max_waiting_steps
        gate = self.residency.gate(self._busy_adapters) if self.residency is not None else None
        while self._waiting and draft.budget > 0 and len(self._running) < self.config.max_num_seqs:
            if len(self._running) >= self.batch_limit and not overdue:
                return
            overdue = False
            request = self._waiting.next(_passed_over(gate, only))
            if request is None:
                return  # every waiting request waits for its adapter's slot
            if gate is not None and not gate.admit(request.adapter):
                continue  # it waits for a slot; the requests behind it may run
            if self._awaits_prompt(request):
                return  # its prompt is being computed: next step it joins on a prefix hit
            num_tokens = min(request.num_tokens + reserve, request.max_total_tokens)
            num_cached = self.allocator.allocate(
                request.request_id, request.token_ids, num_tokens, salt=request.cache_salt
            )
            if num_cached is None:
                return  # admission order: nobody overtakes the request it chose
            self._waiting.remove(request)
            self._running.append(request)
            request.num_computed_tokens = num_cached
            num_new = min(request.num_tokens - num_cached, draft.budget)
            self._add_to_step(request, num_new, draft)
            draft.new_request_ids.append(request.request_id)

    def _busy_adapters(self) -> set[str]:
        """The LoRA adapters running requests use (their slots cannot be taken)."""
        return {request.adapter for request in self._running if request.adapter}

    def _awaits_prompt(self, request: _Request) -> bool:
        """Whether `request` is a copy whose original is running and has not computed the
        prompt's full blocks yet. Only a running original is waited for: one that waits
        (preempted behind its copy) is computing nothing, and waiting on it could stall
        the queue."""
        original = self._requests.get(request.copies) if request.copies is not None else None
        if original is None or not self.allocator.enable_prefix_caching:
            return False
        shared = (request.num_prompt_tokens - 1) // self.config.block_size * self.config.block_size
        return shared > 0 and original.num_computed_tokens < shared and original in self._running

    def _plan_drafts(self) -> dict[int, tuple[int, ...]]:
        """Speculation's drafts for this step's decodes ({} when off, or not worth it)."""
        if self.speculator is None:
            return {}
        decoding = [r for r in self._running if r.is_decoding]
        candidates = _draft_candidates(decoding, num_own_tokens=1)
        drafts = self.speculator.plan(candidates, len(decoding), self.controller.cost)
        self.speculator.tick([c.request_id for c in candidates if c.request_id not in drafts])
        return drafts

    def _ask_for_guesses(self, draft: _StepDraft) -> None:
        """Draft-model speculation: which of the step's decodes the draft model guesses for
        after it, and how many tokens (room for them and one more in the next step). None
        while prompts are computed or wait: the draft's passes and the longer verifying
        step would delay their first tokens, which is not what the decodes' gain is
        weighed against (and a prompt's own first token would wait for the draft's pass
        over the prompt)."""
        assert self.speculator is not None
        decoding = [self._requests[s.request_id] for s in draft.scheduled.values()]
        if self._waiting or not all(r.is_decoding for r in decoding):
            return
        # This step's token and the next step's own come before the guesses' room.
        candidates = _draft_candidates(decoding, num_own_tokens=2)
        wanted = self.speculator.proposals(candidates, len(decoding), self.controller.cost)
        for request_id, num_tokens in wanted.items():
            scheduled = draft.scheduled[request_id]
            draft.scheduled[request_id] = replace(scheduled, num_proposed_tokens=num_tokens)

    def _room_for_drafts(self, request: _Request, draft: _StepDraft) -> tuple[int, ...]:
        """The request's drafts that fit the budget left and blocks free without preempting
        anyone (drafts are optional: they never take a block another request needs).
        Blocks grown for drafts stay in the table when drafts are rejected: the next steps
        write those positions again."""
        tokens = draft.drafts.get(request.request_id, ())
        if not tokens or not request.is_decoding:
            return ()
        tokens = tokens[: max(0, draft.budget - 1)]
        end = request.num_computed_tokens + 1 + len(tokens)
        if not tokens or not self.allocator.grow(request.request_id, end):
            return ()
        return tokens

    def _add_to_step(
        self, request: _Request, num_new: int, draft: _StepDraft, drafts: tuple[int, ...] = ()
    ) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        draft.scheduled[request.request_id] = ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids[start:end]) + drafts,
            start_position=start,
            block_table=self.allocator.block_table(request.request_id),
            slot_mapping=self.allocator.slot_mapping(request.request_id, start, end + len(drafts)),
            produces_token=end == request.num_tokens,
            num_draft_tokens=len(drafts),
        )
        draft.budget -= num_new + len(drafts)

    def _check_result(self, live: list[ScheduledRequest], result: ModelStepResult) -> None:
        """Reject a result that does not match the step, before any state changes."""
        producing = {s.request_id for s in live if s.produces_token}
        missing = [rid for rid in producing if not result.sampled_token_ids.get(rid)]
        if missing:
            raise ValueError(f"no sampled token for requests {sorted(missing)}")
        unexpected = {
            rid
            for rid in (*result.sampled_token_ids, *result.finished_ids)
            if rid in self._requests and rid not in producing
        }
        if unexpected:
            raise ValueError(
                f"tokens or finish reported for requests that sampled nothing: {sorted(unexpected)}"
            )

    def _advance(self, request: _Request, step: ScheduledRequest, result: ModelStepResult) -> None:
        """Record a computed step: its tokens' KV is in the cache (drafts only as far as
        they were accepted), its sampled tokens join the request, full blocks are published."""
        request.num_computed_tokens = step.end_position - step.num_draft_tokens
        prompt_end = min(step.end_position, request.num_prompt_tokens)
        num_prompt = max(0, prompt_end - max(step.start_position, request.num_prompt_charged))
        request.num_prompt_charged = max(request.num_prompt_charged, prompt_end)
        if not step.produces_token:
            self._publish(request)
            self.fairness.charge(request.tenant, num_prompt, 0)
            return
        room = request.max_new_tokens - request.num_output_tokens
        sampled = result.sampled_token_ids[request.request_id][:room]
        request.token_ids.extend(sampled)
        if step.num_draft_tokens and self.speculator is not None:
            # Rollback: the KV of the accepted drafts is valid, that of the rejected ones
            # is stale and their positions are computed again (never published).
            accepted = max(0, min(len(sampled) - 1, step.num_draft_tokens))
            request.num_computed_tokens += accepted
            self.speculator.record(request.request_id, step.num_draft_tokens, len(sampled))
        guesses = result.proposed_token_ids.get(request.request_id)
        if guesses and self.speculator is not None:
            self.speculator.offer(request.request_id, guesses, request.num_tokens)
        self._publish(request)
        self.fairness.charge(request.tenant, num_prompt, len(sampled))
        if (
            request.request_id in result.finished_ids
            or request.num_output_tokens >= request.max_new_tokens
        ):
            self._finish(request)

    def _publish(self, request: _Request) -> None:
        self.allocator.cache_blocks(
            request.request_id, request.token_ids, request.num_computed_tokens
        )

    def _finish(self, request: _Request) -> None:
        self._running.remove(request)
        del self._requests[request.request_id]
        self.allocator.free(request.request_id)
        self._finished_ids.append(request.request_id)
        if self.speculator is not None:
            self.speculator.drop(request.request_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if scheduler and allocator disagree (tests and debugging)."""
        self.allocator.check_invariants()
        running = {request.request_id for request in self._running}
        waiting = {request.request_id for request in self._waiting}
        assert len(running) == len(self._running) and len(waiting) == len(self._waiting)
        assert not running & waiting, "a request is both running and waiting"
        assert running | waiting == set(self._requests), "a request was lost"
        assert len(running) <= self.config.max_num_seqs
        for request in self._running:
            table = self.allocator.block_table(request.request_id)
            assert len(table) * self.config.block_size >= request.num_computed_tokens
            assert request.num_computed_tokens < request.num_tokens, (
                "running request has nothing to compute"
            )
        self._waiting.check_invariants()
        if self.residency is not None:
            assert self._busy_adapters() <= set(self.residency.resident), "adapter not resident"
        for request in self._waiting:
            assert not self.allocator.has_table(request.request_id), "waiting request holds blocks"
            assert request.num_computed_tokens == 0


def _passed_over(
    gate: LoraGate | None, only: tuple[set[str], int] | None
) -> Callable[[_Request], bool] | None:
    """What admission skips this step: requests whose adapter waits for a slot (`gate`), and
    with `only` (tenants, priority) every request of another tenant or priority, or already
    preempted (they go in the usual step)."""
    waits = gate.passed_over if gate is not None else None
    if only is None:
        return waits

    tenants, priority = only

    def skipped(request: _Request) -> bool:
        if request.tenant not in tenants or request.priority != priority or request.preempted:
            return True
        return waits is not None and waits(request)

    return skipped


def _draft_candidates(requests: Sequence[_Request], num_own_tokens: int) -> list[Candidate]:
    """The requests that have room for drafts beyond `num_own_tokens` more tokens of their
    own before their max_new_tokens, as speculation's candidates."""
    return [
        Candidate(r.request_id, r.token_ids, room - num_own_tokens)
        for r in requests
        if (room := r.max_new_tokens - r.num_output_tokens) > num_own_tokens
    ]
