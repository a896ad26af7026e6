from __future__ import annotations

import numpy as np
import pytest

from textgate.bench.serving.metrics import (
    GoodputTargets,
    LatencyStats,
    RequestOutcome,
    compute_metrics,
    percentiles,
    tpot,
)


def outcome(ttft: float, itl: list[float], prompt_len: int = 10) -> RequestOutcome:
    """A successful request whose tokens arrived at ttft, then after each gap in itl."""
    return RequestOutcome(
        success=True,
        prompt_len=prompt_len,
        output_tokens=len(itl) + 1,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
    )


def test_percentiles_interpolate_linearly_like_numpy() -> None:
    sample = [0.1, 0.2, 0.3, 0.4, 1.0]
    assert percentiles(sample, [50, 90, 99]) == pytest.approx([0.3, 0.76, 0.976])
    assert percentiles(sample, [99]) == pytest.approx([float(np.percentile(sample, 99))])


def test_percentiles_of_empty_sample_are_zero() -> None:
    assert percentiles([], [50, 99]) == [0.0, 0.0]
    assert LatencyStats.of([]) == LatencyStats(0.0, 0.0, 0.0, 0.0)


def test_latency_stats_are_in_milliseconds() -> None:
    stats = LatencyStats.of([0.010, 0.020, 0.030])
    assert stats.mean_ms == pytest.approx(20.0)
    assert stats.p50_ms == pytest.approx(20.0)
    assert stats.p90_ms == pytest.approx(28.0)
    assert stats.p99_ms == pytest.approx(29.8)


def test_tpot_excludes_the_first_token() -> None:
    # 1 s to the first token, then 4 more tokens in 2 s: 0.5 s per output token.
    o = outcome(1.0, [0.5, 0.5, 0.5, 0.5])
    assert tpot(o) == pytest.approx(0.5)


def test_tpot_is_undefined_for_single_token_requests() -> None:
    assert tpot(outcome(1.0, [])) is None


def test_compute_metrics_on_synthetic_timings() -> None:
    a = outcome(0.1, [0.02, 0.04], prompt_len=10)  # 3 tokens, e2e 0.16
    b = outcome(0.3, [0.01, 0.01, 0.01, 0.01], prompt_len=20)  # 5 tokens, e2e 0.34
    single = outcome(0.2, [], prompt_len=5)  # 1 token: counted, but no TPOT
    failed = RequestOutcome(success=False, prompt_len=99, error="HTTP 500: oops")
    m = compute_metrics([a, b, single, failed], duration_s=2.0)

    assert (m.completed, m.failed, m.first_error) == (3, 1, "HTTP 500: oops")
    assert m.total_input_tokens == 35  # failed requests count nothing
    assert m.total_output_tokens == 9
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(22.0)
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.p50_ms == pytest.approx(200.0)
    # TPOT per request: a (0.16-0.1)/2 = 0.03, b (0.34-0.3)/4 = 0.01.
    assert m.tpot.mean_ms == pytest.approx(20.0)
    assert m.tpot.p90_ms == pytest.approx(28.0)
    # ITL pools every gap of every request.
    assert m.itl.mean_ms == pytest.approx(np.mean([0.02, 0.04, 0.01, 0.01, 0.01, 0.01]) * 1e3)
    assert m.itl.p99_ms == pytest.approx(np.percentile([20, 40, 10, 10, 10, 10], 99))
    assert m.e2el.p50_ms == pytest.approx(200.0)
    assert m.e2el.mean_ms == pytest.approx((0.16 + 0.34 + 0.2) / 3 * 1e3)


def test_all_failed_gives_zero_throughput_and_latencies() -> None:
    m = compute_metrics([RequestOutcome(success=False, error="x")], duration_s=1.0)
    assert (m.completed, m.failed, m.output_throughput) == (0, 1, 0.0)
    assert m.ttft == LatencyStats(0.0, 0.0, 0.0, 0.0)


def test_duration_must_be_positive() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], 0.0)


def test_a_good_request_meets_both_targets() -> None:
    targets = GoodputTargets(ttft_ms=150.0, itl_ms=25.0)
    assert targets.is_good(outcome(0.1, [0.02, 0.02]))
    assert not targets.is_good(outcome(0.2, [0.02, 0.02]))  # first token too late
    # One 40 ms stall in a 20 ms stream: the mean gap, 26.7 ms, misses 25 ms.
    assert not targets.is_good(outcome(0.1, [0.02, 0.02, 0.04]))
    assert targets.is_good(outcome(0.1, []))  # one token: no ITL to judge
    assert not targets.is_good(RequestOutcome(success=False, ttft=0.0))


def test_goodput_counts_good_requests_per_second_and_of_all_sent() -> None:
    good = outcome(0.1, [0.01, 0.01])
    late = outcome(3.0, [0.01, 0.01])
    failed = RequestOutcome(success=False, error="x")
    m = compute_metrics([good, good, late, failed], 2.0, GoodputTargets(2000.0, 200.0))
    assert (m.good_requests, m.goodput, m.good_fraction) == (2, 1.0, 0.5)
    assert m.goodput_targets == GoodputTargets(2000.0, 200.0)


def test_goodput_targets_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        GoodputTargets(ttft_ms=0.0)
