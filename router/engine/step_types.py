"""The scheduler's vocabulary: its config and the data-only input and output of a step.

`SchedulerConfig` is built once by the launcher; every step the `Scheduler` hands a
`SchedulerOutput` (one `ScheduledRequest` per request computed) to the shards, and
gets a `ModelStepResult` back. Plain frozen dataclasses: no behaviour beyond checks
and derived sizes, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from textgate.router.engine.batch_controller import ControllerConfig
from textgate.router.engine.kv_tiers import KvTransfer
from textgate.router.engine.speculation import SpeculationConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler works under; built once by the launcher."""

    num_blocks: int
    """KV-cache blocks in the pool (the shards size the cache at warmup)."""
    block_size: int = 16
    """Tokens per KV-cache block (`InfoResponse.block_size`)."""
    max_num_batched_tokens: int = 4096
    """Most tokens computed in one step (TGI's --max-batch-prefill-tokens)."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    num_reserved_tokens: int = 16
    """Decode tokens allocated beyond the prompt at admission, so decoding starts without growing."""
    enable_prefix_caching: bool = True
    """Share computed prompt blocks between requests with the same prefix."""
    adaptive: bool = False
    """Let the batch controller pick each step's prefill share and the batch limit from
    measured step times (the router turns it on by default); False = fixed budgets."""
    target_itl_s: float | None = None
    """Adaptive: inter-token latency each step aims at; None = derived from measured steps."""
    target_ttft_s: float | None = None
    """Adaptive: time to first token the prefill share defends; None = derived from the
    inter-token target (`batch_controller.TTFT_STEPS` of it)."""
    min_prefill_tokens: int = 32
    """Adaptive: the least prompt tokens a step may run while prompts wait (capped at
    max_num_batched_tokens)."""
    min_batch_size: int = 16
    """Adaptive: the batch limit never goes below this (`ControllerConfig.min_batch_size`)."""
    max_waiting_steps: int = 20
    """Adaptive: once no request joined for this many steps, the head of the queue joins past
    the batch limit (TGI's --max-waiting-tokens), so queue time stays bounded."""
    speculation: SpeculationConfig | None = None
    """N-gram speculative decoding (--speculate); None = off."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_reserved_tokens < 0:
            raise ValueError(f"num_reserved_tokens must be >= 0, got {self.num_reserved_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode each step"
            )
        if self.target_itl_s is not None and self.target_itl_s <= 0:
            raise ValueError(f"target_itl_s must be > 0, got {self.target_itl_s}")
        if self.target_ttft_s is not None and self.target_ttft_s <= 0:
            raise ValueError(f"target_ttft_s must be > 0, got {self.target_ttft_s}")
        if self.min_prefill_tokens < 1:
            raise ValueError(
                f"min_prefill_tokens must be at least 1, got {self.min_prefill_tokens}"
            )
        if self.max_waiting_steps < 0:
            raise ValueError(f"max_waiting_steps must be >= 0, got {self.max_waiting_steps}")

    def controller_config(self) -> ControllerConfig:
        """The batch controller's bounds: the step's token ceiling and max_num_seqs."""
        return ControllerConfig(
            max_prefill_tokens=self.max_num_batched_tokens,
            max_batch_size=self.max_num_seqs,
            adaptive=self.adaptive,
            target_itl_s=self.target_itl_s,
            target_ttft_s=self.target_ttft_s,
            min_prefill_tokens=min(self.min_prefill_tokens, self.max_num_batched_tokens),
            min_batch_size=min(self.min_batch_size, self.max_num_seqs),
        )

    @property
    def max_num_cached_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions [start, end)."""

    request_id: int
    token_ids: tuple[int, ...]
    """The tokens to compute this step (a prompt chunk, or the last sampled token)."""
    start_position: int
    """Position of the first token; everything before it is already in the KV cache
    (on a request's first step: its prefix-cache hit, `Request.cache_len` in the contract)."""
    block_table: tuple[int, ...]
    """The request's KV blocks in token order (may extend past this step's tokens)."""
    slot_mapping: tuple[int, ...]
    """KV slot of each token in `token_ids`."""
    produces_token: bool
    """Whether this step completes the request's tokens, so its next token is sampled."""
    num_draft_tokens: int = 0
    """Speculation: the last this many of `token_ids` are proposed tokens the shards verify
    (their KV is written at the following slots, and rolled back where rejected)."""
    num_proposed_tokens: int = 0
    """Draft-model speculation: after the step, the shards' draft model guesses this many
    tokens after the request's last (the drafts of its next step)."""

    @property
    def num_new_tokens(self) -> int:
        """Tokens computed this step: 1 for a decode, up to the budget for a prefill chunk."""
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """One past the position of the last token computed this step."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the shards need for one step; data only."""

    scheduled: tuple[ScheduledRequest, ...]
    """Requests computed this step: running decodes first, then prefill chunks."""
    new_request_ids: tuple[int, ...]
    """Requests admitted this step (first step of their prompt, or of their recompute)."""
    preempted_ids: tuple[int, ...]
    """Requests whose blocks were taken back; shards drop their state, they recompute later."""
    finished_ids: tuple[int, ...]
    """Running requests that finished or were aborted since the last step; shards drop them."""
    token_budget: int
    """The token budget this step was planned under."""
    kv_transfers: tuple[KvTransfer, ...] = ()
    """KV-tier copies the shards run, in order, before the step writes (`kv_tiers`)."""

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed this step (never more than `token_budget`)."""
        return sum(request.num_new_tokens for request in self.scheduled)


@dataclass(frozen=True)
class ModelStepResult:
    """What the shards report back after running a `SchedulerOutput`."""

    sampled_token_ids: Mapping[int, Sequence[int]] = field(default_factory=dict)
    """Request id -> tokens sampled this step, for each request scheduled with produces_token
    (several where drafts were accepted: the accepted drafts, then the shards' own token)."""
    finished_ids: frozenset[int] = frozenset()
    """Requests the shard's stopping criteria ended this step (eos, stop sequence, length)."""
    step_latency_s: float | None = None
    """Measured wall time of the step; feeds the batch controller when set."""
    utilization: float = 0.0
    """Busy fraction of the device over the recent past, reported with the latency."""
    proposed_token_ids: Mapping[int, Sequence[int]] = field(default_factory=dict)
    """Draft-model speculation: request id -> the draft model's guesses after its tokens."""
    draft_s: float = 0.0
    """Of `step_latency_s`, the time the draft model took guessing them."""
    draft_pass_s: float = 0.0
    """Of `draft_s`, the mean time of a guessing pass (0: none was timed)."""
    draft_pass_rows: float = 0.0
    """The mean sequences in those passes."""
