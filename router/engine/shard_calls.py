"""The calls an engine makes to the shards: bounded by a deadline, timed, traced.

Every call (a step, the empty step that only drops finished requests, a ClearCache)
goes through `ShardCalls`: one the shards do not answer within `timeout_s`
(`--shard-step-timeout`) raises `ShardTimeoutError`, so a hung shard is reported and
never waited on forever. `ShardCalls.run` is a step's call: it records TGI's
per-method metrics and the step's span, and turns any failure into `StepFailed`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import TypeVar

from textgate.proto import generate_pb2 as pb
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient
from textgate.router.tracing import RequestTrace, step_span

log = logging.getLogger("textgate.router")
T = TypeVar("T")

DEFAULT_STEP_TIMEOUT_S = 600.0
"""How long one step RPC may take before the shards count as hung (`--shard-step-timeout`)."""


class ShardTimeoutError(TimeoutError):
    """The shards did not answer a call within --shard-step-timeout: they count as hung."""

    def __init__(self, call: str, timeout_s: float) -> None:
        super().__init__(
            f"the shards did not answer {call} within {timeout_s:g} s (--shard-step-timeout)"
        )


class StepFailed(Exception):
    """A step's call to the shards failed; the message is what its requests are told."""


class ShardCalls:
    """The shard calls an engine makes, each bounded by `timeout_s` (ShardTimeoutError
    past it; the call itself is cancelled)."""

    def __init__(self, shards: ShardedClient, metrics: Metrics) -> None:
        self.shards = shards
        self.metrics = metrics
        self._timeout_s = DEFAULT_STEP_TIMEOUT_S

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"the shard-call timeout must be > 0 s, got {seconds}")
        self._timeout_s = seconds

    async def run(
        self,
        method: str,
        answer: Awaitable[pb.StepResponse],
        traces: Iterable[RequestTrace | None] = (),
    ) -> pb.StepResponse:
        """Await one step RPC (TGI's `method` label: prefill or decode) within its span and
        metrics; StepFailed, with the message for its requests, when it fails."""
        started = time.monotonic()
        try:
            with step_span(method, traces):
                response = await answer
        except Exception as exc:
            if isinstance(exc, ShardTimeoutError):
                exc = ShardTimeoutError(f"a {method} step", self.timeout_s)
            self.metrics.batch_inference(method, time.monotonic() - started, None)
            log.error("shard call failed: %s", exc)
            raise StepFailed(f"Request failed during generation: {exc}") from exc
        self.metrics.batch_inference(method, time.monotonic() - started, response)
        return response

    async def step(self, requests: Sequence[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        return await self._within_deadline("a Step", self.shards.step(requests, plan))

    async def clear_cache(self) -> None:
        """Drop every request's state from the shards; failures are logged."""
        try:
            await self._within_deadline("a ClearCache", self.shards.clear_cache())
        except Exception as exc:
            log.error("ClearCache failed: %s", exc)

    async def _within_deadline(self, call: str, answer: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(answer, self._timeout_s)
        except asyncio.TimeoutError:
            raise ShardTimeoutError(call, self._timeout_s) from None
