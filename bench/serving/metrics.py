"""Serving metrics, defined exactly as `vllm bench serve` defines them.

Per successful request the client records the time to the first token (TTFT), every gap
between consecutive token-bearing stream events (ITL), and the end-to-end latency (E2E:
request sent → last token received). From those:

- TPOT (time per output token, first token excluded) = (E2E - TTFT) / (output_tokens - 1),
  only for requests with more than one output token;
- request throughput = completed requests / benchmark duration;
- output token throughput = output tokens of completed requests / duration;
- total token throughput = (input + output tokens of completed requests) / duration;
- goodput = good requests / duration, a request being good when it succeeded within both
  latency targets (`GoodputTargets`: TTFT, and TPOT, its mean inter-token latency), as in
  `vllm bench serve --goodput ttft:T tpot:I` and DistServe; `good_fraction` = good / all
  requests sent (failed ones included).

Latencies are summarised by mean and percentiles (numpy's linear interpolation); an empty
sample summarises to zeros, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestOutcome:
    """What the client observed for one request (times in seconds, `time.perf_counter`)."""

    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency metric, in milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        """Summarise a sample given in seconds."""
        p50, p90, p99 = percentiles(seconds, PERCENTILES)
        mean = float(np.mean(seconds)) if len(seconds) else 0.0
        return cls(mean_ms=mean * 1e3, p50_ms=p50 * 1e3, p90_ms=p90 * 1e3, p99_ms=p99 * 1e3)


@dataclass(frozen=True)
class GoodputTargets:
    """The latency targets a request must meet to count towards goodput, in milliseconds.

    The defaults suit a small model on a 2-core CPU: a first token within 2 s, then at
    least 5 tokens/s (about reading speed) on average over the request.
    """

    ttft_ms: float = 2000.0
    """Longest time to the first token."""
    itl_ms: float = 200.0
    """Longest mean inter-token latency of the request (its TPOT); one-token requests have
    none and are judged by TTFT alone."""

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError(f"goodput targets must be positive, got {self}")

    def is_good(self, outcome: RequestOutcome) -> bool:
        """Whether `outcome` succeeded within both targets."""
        if not outcome.success or outcome.ttft * 1e3 > self.ttft_ms:
            return False
        per_token = tpot(outcome)
        return per_token is None or per_token * 1e3 <= self.itl_ms


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The metrics of one run (one load level against one server)."""

    completed: int
    failed: int
    first_error: str
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    good_requests: int = 0
    goodput: float = 0.0
    """Good requests per second."""
    good_fraction: float = 0.0
    """Good requests / requests sent."""
    goodput_targets: GoodputTargets = GoodputTargets()


def percentiles(sample: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Linear-interpolated percentiles (numpy's default); zeros for an empty sample."""
    if not len(sample):
        return [0.0 for _ in qs]
    return [float(v) for v in np.percentile(np.asarray(sample, dtype=np.float64), list(qs))]


def tpot(outcome: RequestOutcome) -> float | None:
    """Time per output token after the first; None when there is at most one token."""
    if outcome.output_tokens <= 1:
        return None
    return (outcome.latency - outcome.ttft) / (outcome.output_tokens - 1)


def compute_metrics(
    outcomes: Sequence[RequestOutcome],
    duration_s: float,
    goodput: GoodputTargets = GoodputTargets(),
) -> BenchmarkMetrics:
    """Aggregate the outcomes of a run that took `duration_s` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [o for o in outcomes if o.success]
    failed = [o for o in outcomes if not o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [t for t in (tpot(o) for o in ok) if t is not None]
    good = sum(goodput.is_good(o) for o in ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(failed),
        first_error=failed[0].error if failed else "",
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=LatencyStats.of([o.ttft for o in ok]),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of([gap for o in ok for gap in o.itl]),
        e2el=LatencyStats.of([o.latency for o in ok]),
        good_requests=good,
        goodput=good / duration_s,
        good_fraction=good / len(outcomes) if outcomes else 0.0,
        goodput_targets=goodput,
    )
