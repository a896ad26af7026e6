"""Cost per token: each step's measured busy time split between the prompt tokens and the
generated tokens it computed, per tenant, priced at --device-hour-cost.

What is measured (docs/scaling.md, "Cost per token"): a step's busy time is the engine's
own interval for it (the shard call and the routing of its tokens, what `BusyMeter`
records). It is split over the step's requests, and within a request between its input
side (prompt chunks, and recomputing known tokens after a preemption) and its output
side (its decode, and any drafts it verifies), in proportion to what the step cost model
(`step_cost.StepCostModel`) says each part adds to the step; the step's fixed overhead goes
along in the same proportion. Then

    cost per 1k input tokens  = device_hour_cost x input busy hours / prompt tokens x 1000
    cost per 1k output tokens = device_hour_cost x output busy hours / generated tokens x 1000

over the steps of the last `window_s` seconds. Prompt tokens are those computed (a prefix
cache hit costs nothing and is not counted); generated tokens are every token a request
got, its first one included (that one comes out of its last prompt chunk, whose time is
input time). Idle time is nobody's: the costs are what busy device time buys.

Pure Python, no I/O; a few float operations per request and step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from textgate.router.engine.fairness import ANONYMOUS_TENANT
from textgate.router.engine.step_cost import NUM_COEFFICIENTS, attention_pairs
from textgate.router.metrics_collectors import CostRates, CostReport

DEFAULT_WINDOW_S = 60.0
"""Seconds of steps the live costs are computed over."""


@dataclass(frozen=True)
class TokenWork:
    """One request's part of one step, as the cost meter splits the step."""

    tenant: str
    """Whose request it is (`ValidRequest.tenant`; "" anonymous)."""
    start_position: int
    """Position of the first token computed."""
    num_known_tokens: int
    """Tokens of known content computed: a prompt chunk, a recompute, or a decode's 1."""
    num_prompt_tokens: int
    """Of those, the prompt's (positions below the prompt's length)."""
    decodes: bool
    """Whether the known token computed is its last generated one (a decode step)."""
    num_draft_tokens: int = 0
    """Proposed tokens it verified (speculation): output work."""
    num_output_tokens: int = 0
    """Tokens it got this step (sampled, accepted drafts included)."""

    def __post_init__(self) -> None:
        counts = (self.num_known_tokens, self.num_prompt_tokens, self.num_draft_tokens)
        if min(*counts, self.num_output_tokens, self.start_position) < 0:
            raise ValueError(f"token counts and positions must be >= 0: {self}")
        if self.num_prompt_tokens > self.num_known_tokens:
            raise ValueError(f"more prompt tokens than tokens computed: {self}")
        if self.decodes and (self.num_known_tokens != 1 or self.num_prompt_tokens):
            raise ValueError(f"a decode computes one generated token: {self}")


def split_step(
    busy_s: float, works: Sequence[TokenWork], coefficients: Sequence[float]
) -> list[tuple[float, float]]:
    """Each work's (input seconds, output seconds) of a step that kept the device busy
    `busy_s`: in proportion to the cost model's marginal cost of each part (`coefficients`
    as `StepCostModel.coefficients`), so the parts add up to `busy_s`. Where the model
    gives no part any cost (not fitted yet), in proportion to tokens computed."""
    if not math.isfinite(busy_s) or busy_s < 0:
        raise ValueError(f"busy time must be a finite number >= 0, got {busy_s}")
    if len(coefficients) != NUM_COEFFICIENTS:
        raise ValueError(f"expected {NUM_COEFFICIENTS} coefficients, got {len(coefficients)}")
    weights = [_modelled(work, coefficients) for work in works]
    total = sum(i + o for i, o in weights)
    if not total > 0:
        weights = [_counted(work) for work in works]
        total = sum(i + o for i, o in weights)
    if not total > 0:
        return [(0.0, 0.0) for _ in works]
    scale = busy_s / total
    return [(i * scale, o * scale) for i, o in weights]


def _modelled(work: TokenWork, coefficients: Sequence[float]) -> tuple[float, float]:
    """What the cost model says the work's input and output parts add to its step (s).
    As the scheduler feeds the model, drafts cost what prompt tokens do, over the context
    after the decode's token."""
    _, per_decode, per_prefill, per_attention = coefficients
    drafts = work.num_draft_tokens
    output = per_prefill * drafts + per_attention * attention_pairs(work.start_position + 1, drafts)
    if work.decodes:
        return 0.0, per_decode + output
    known = work.num_known_tokens
    return per_prefill * known + per_attention * attention_pairs(work.start_position, known), output


def _counted(work: TokenWork) -> tuple[float, float]:
    if work.decodes:
        return 0.0, 1.0 + work.num_draft_tokens
    return float(work.num_known_tokens), float(work.num_draft_tokens)


@dataclass
class _Totals:
    """Busy seconds and tokens, input and output."""

    input_s: float = 0.0
    output_s: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, other: _Totals) -> None:
        self.input_s += other.input_s
        self.output_s += other.output_s
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens

    def rates(self, device_hour_cost: float) -> CostRates:
        return CostRates(
            input_busy_s=self.input_s,
            output_busy_s=self.output_s,
            num_input_tokens=self.input_tokens,
            num_output_tokens=self.output_tokens,
            per_1k_input_tokens_usd=_per_1k(device_hour_cost, self.input_s, self.input_tokens),
            per_1k_output_tokens_usd=_per_1k(device_hour_cost, self.output_s, self.output_tokens),
        )


def _per_1k(device_hour_cost: float, busy_s: float, num_tokens: int) -> float | None:
    if num_tokens == 0:
        return None
    return device_hour_cost * busy_s / 3600.0 / num_tokens * 1000.0


@dataclass
class _StepCharge:
    at: float
    by_tenant: dict[str, _Totals] = field(default_factory=dict)


class CostMeter:
    """The steps of the last `window_s` seconds, attributed by `split_step`, and every
    step's since startup; `report` prices them at `device_hour_cost` USD per device hour.

    A device hour is one hour of the whole serving group (every shard): the price of the
    machines one launcher (and its nodes) holds.
    """

    def __init__(
        self,
        device_hour_cost: float,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(device_hour_cost) and device_hour_cost > 0):
            raise ValueError(
                f"device_hour_cost must be a finite number > 0, got {device_hour_cost}"
            )
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.device_hour_cost = device_hour_cost
        self.window_s = window_s
        self._clock = clock
        self._window: deque[_StepCharge] = deque()
        self._lifetime: dict[str, _Totals] = {}

    def record(
        self, busy_s: float, works: Iterable[TokenWork], coefficients: Sequence[float]
    ) -> None:
        """One step that kept the device busy `busy_s` seconds computing `works`."""
        works = list(works)
        charge = _StepCharge(self._clock())
        for work, (input_s, output_s) in zip(
            works, split_step(busy_s, works, coefficients), strict=True
        ):
            part = _Totals(input_s, output_s, work.num_prompt_tokens, work.num_output_tokens)
            charge.by_tenant.setdefault(work.tenant, _Totals()).add(part)
            self._lifetime.setdefault(work.tenant, _Totals()).add(part)
        self._window.append(charge)

    def report(self) -> CostReport:
        """The costs now: over the window and since startup, overall and per named tenant
        (anonymous requests count in the overall costs only)."""
        now = self._clock()
        while self._window and self._window[0].at + self.window_s <= now:
            self._window.popleft()
        window: dict[str, _Totals] = {}
        for charge in self._window:
            for tenant, totals in charge.by_tenant.items():
                window.setdefault(tenant, _Totals()).add(totals)
        cost = self.device_hour_cost
        return CostReport(
            device_hour_cost_usd=cost,
            window_s=self.window_s,
            window=_sum(window.values()).rates(cost),
            lifetime=_sum(self._lifetime.values()).rates(cost),
            tenants=_named(window, cost),
            tenants_lifetime=_named(self._lifetime, cost),
        )


def _sum(parts: Iterable[_Totals]) -> _Totals:
    total = _Totals()
    for part in parts:
        total.add(part)
    return total


def _named(by_tenant: dict[str, _Totals], device_hour_cost: float) -> dict[str, CostRates]:
    return {
        tenant: totals.rates(device_hour_cost)
        for tenant, totals in sorted(by_tenant.items())
        if tenant != ANONYMOUS_TENANT
    }
