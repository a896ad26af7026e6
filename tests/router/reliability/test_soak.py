"""The soak's short version: its traffic against a router on a fake shard, over loopback.

`make soak` runs the long one against the default model (bench/soak/); this keeps the
soak's client, its checks and the table it prints honest in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

from textgate.bench.soak.run import markdown_rows, soak, summary, verdict
from textgate.bench.soak.traffic import plan_request
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer

REQUESTS = 60


def soak_args(**overrides: Any) -> argparse.Namespace:
    defaults = {
        "requests": REQUESTS,
        "concurrency": 8,
        "seed": 0,
        "max_rss_growth": 0.05,
        "max_p99_ratio": 1.5,
    }
    return argparse.Namespace(**(defaults | overrides))


def test_a_short_soak_loses_nothing_and_leaves_the_engine_idle(
    serve_in_thread: Callable[..., Any],
) -> None:
    args = soak_args()
    served = serve_in_thread(
        step_delay_s=0.002, max_concurrent_requests=16, tokenizer=ChatFakeTokenizer()
    )
    with served as router:
        report = asyncio.run(soak(router.url, None, args))
    failed = [f for f in verdict(report, args) if not f.startswith("p99")]  # timing: not here
    assert failed == [], failed
    assert report.problems == []
    assert sum(report.outcomes.values()) == REQUESTS
    # The seeded mix has every kind of request: served, deliberately invalid, cancelled.
    assert {"200", "422", "cancelled"} <= set(report.statuses), report.statuses
    assert report.gauges_end["textgate_kv_cache_blocks_used"] == 0
    assert report.gauges_end["textgate_kv_cache_blocks_free"] > 0
    # Five windows of 12 completions, each with the server's queue and inference split.
    assert report.window_size == 12 and [w.requests for w in report.windows] == [12] * 5
    assert all(w.mean_queue_s is not None and w.inference_s_per_token for w in report.windows)
    result = summary(report, [], ["soak"])
    assert result["unexpected"] == 0 and len(result["windows"]) == 5
    table = markdown_rows(report, [], args)
    assert f"| outcomes | {REQUESTS} requests in " in table and "**0 unexpected**" in table
    assert table.count("\n| ") == 4 + 1 + 5, table  # 4 checks, the window header, 5 windows


def test_a_failed_check_says_what_else_changed() -> None:
    from textgate.bench.soak.run import Report, Window

    report = Report(requests=10, concurrency=2, window_size=5)
    report.windows = [
        Window(5, 1.0, 0.1, load_avg_1m=1.0, mean_queue_s=0.01, inference_s_per_token=0.02),
        Window(5, 3.0, 0.4, load_avg_1m=6.0, mean_queue_s=0.03, inference_s_per_token=0.08),
    ]
    (failed,) = verdict(report, soak_args(requests=10))
    assert failed.startswith("p99 s/token rose from 0.1000 to 0.4000 (limit x1.5)")
    assert "load average 1.0 -> 6.0" in failed
    assert "server inference s/token 0.020 -> 0.080 (x4.00)" in failed
    assert "mean queue wait 0.01 -> 0.03 s" in failed
    assert "| p99 s/token |" in markdown_rows(report, [failed], soak_args()) and "**fail**" in (
        markdown_rows(report, [failed], soak_args())
    )


def test_the_request_mix_is_seeded_and_covers_every_route() -> None:
    import random

    plans = [plan_request(random.Random(7)) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    rng = random.Random(0)
    mix = [plan_request(rng) for _ in range(400)]
    assert {p.path for p in mix} == {
        "/generate",
        "/generate_stream",
        "/v1/chat/completions",
        "/v1/completions",
    }
    assert 0.02 < sum(p.invalid for p in mix) / len(mix) < 0.10
    assert 0.05 < sum(p.cancel_after_s is not None for p in mix) / len(mix) < 0.15
