"""Soak: many mixed requests against a real launcher; nothing lost, nothing leaks.

    python -m textgate.bench.soak --requests 5000            # starts the default model
    python -m textgate.bench.soak --url http://host:8080     # an already running server

Requests are drawn at random (seeded, `traffic.plan_request`): /generate,
/generate_stream, /v1/chat/completions and /v1/completions, streamed or not, with random
sampling parameters and lengths; a share are deliberately invalid (each must get 422) and
a share are cancelled by their client (mid-stream, or before the answer). They run
`--concurrency` at a time. At the end:

- zero unexpected outcomes (a 5xx, a 429 under the admission limit, an error event, a
  stream without its final event, an invalid request not answered 422, a hang);
- RSS of the server's processes (launcher, router, shards) grew < `--max-rss-growth`
  between the end of warm-up (the first tenth, at most 500 requests) and the end;
- the KV allocator is idle again: no block used, the free-block count exactly the
  allocator's total, no running batch, an empty queue (from /metrics);
- p99 latency per generated token of the last window is within `--max-p99-ratio` of
  the first window's (windows of 1,000 completions, or a fifth of the run if smaller).

Each window also records what tells a slower machine from a scheduler that queues too
long: its wall time, the load average, and from the server's /metrics the mean queue
wait and the inference seconds per generated token of the requests it finished.

Prints a JSON summary on stdout (also written to `--output`) and the markdown rows of
docs/reliability.md's soak table on stderr; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from textgate.bench.soak.server import (
    TOTALS,
    launched_server,
    read_metrics,
    tree_rss_bytes,
    wait_idle,
)
from textgate.bench.soak.traffic import REQUEST_TIMEOUT_S, Outcome, plan_request, run_one


@dataclass
class Window:
    """A stretch of consecutive completions, and how the server fared during it."""

    requests: int
    seconds: float
    """Wall time from the previous window's end (or the start) to this one's."""
    p99_s_per_token: float
    """Over the requests that generated tokens and ended as they should."""
    load_avg_1m: float
    """The machine's 1-minute load average at the window's end."""
    mean_queue_s: float | None = None
    """Server side: mean time in the queue of the requests it finished in the window."""
    inference_s_per_token: float | None = None
    """Server side: inference seconds per generated token over the window."""


@dataclass
class Report:
    requests: int
    concurrency: int
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    rss_after_warmup: int = 0
    rss_end: int = 0
    gauges_after_warmup: dict[str, float] = field(default_factory=dict)
    gauges_end: dict[str, float] = field(default_factory=dict)
    window_size: int = 0
    windows: list[Window] = field(default_factory=list)

    @property
    def p99_first(self) -> float:
        return self.windows[0].p99_s_per_token if self.windows else 0.0

    @property
    def p99_last(self) -> float:
        return self.windows[-1].p99_s_per_token if self.windows else 0.0


def window_size(requests: int) -> int:
    """Completions per window: 1,000, or a fifth of a shorter run."""
    return min(1000, max(1, requests // 5))


class WindowRecorder:
    """Closes a window each `size` completions (the last one takes the remainder)."""

    def __init__(self, client: httpx.AsyncClient, requests: int) -> None:
        self._client = client
        self.size = window_size(requests)
        self._num_windows = max(1, requests // self.size)
        self._started = time.monotonic()
        self._totals: dict[str, float] = {}
        self.windows: list[Window] = []

    async def start(self) -> None:
        self._started = time.monotonic()
        self._totals = await read_metrics(self._client, TOTALS)

    def closes_at(self, completed: int, requests: int) -> bool:
        """Whether the `completed`-th completion ends a window."""
        if completed == requests:
            return True
        return completed % self.size == 0 and completed // self.size < self._num_windows

    async def close(self, outcomes: list[Outcome]) -> None:
        """End the current window; `outcomes` are its completions."""
        now = time.monotonic()
        per_token = [o.seconds / o.tokens for o in outcomes if o.tokens > 0 and o.problem is None]
        window = Window(len(outcomes), now - self._started, p99(per_token), os.getloadavg()[0])
        self._started = now
        # A --url server's other traffic counts here too; a launched one serves the soak alone.
        totals = await read_metrics(self._client, TOTALS)
        delta = {name: totals.get(name, 0.0) - self._totals.get(name, 0.0) for name in TOTALS}
        self._totals = totals
        if delta["tgi_request_queue_duration_count"]:
            window.mean_queue_s = (
                delta["tgi_request_queue_duration_sum"] / delta["tgi_request_queue_duration_count"]
            )
        if delta["tgi_request_generated_tokens_sum"]:
            window.inference_s_per_token = (
                delta["tgi_request_inference_duration_sum"]
                / delta["tgi_request_generated_tokens_sum"]
            )
        self.windows.append(window)


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def soak(url: str, server_pid: int | None, args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    plans = [plan_request(rng) for _ in range(args.requests)]
    warmup = max(1, min(args.requests // 10, 500))
    report = Report(args.requests, args.concurrency)
    done: list[Outcome] = []
    """Outcomes in the order they completed."""
    window_start = 0
    next_index = 0
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        recorder = WindowRecorder(client, len(plans))

        async def worker() -> None:
            nonlocal next_index, window_start
            while next_index < len(plans):
                index = next_index
                next_index += 1
                done.append(await run_one(client, plans[index]))
                completed = len(done)
                if completed == warmup:
                    await mark_warm()
                if recorder.closes_at(completed, len(plans)):
                    window, window_start = done[window_start:completed], completed
                    await recorder.close(window)

        async def mark_warm() -> None:
            if server_pid is not None:
                report.rss_after_warmup = tree_rss_bytes(server_pid)
            report.gauges_after_warmup = await read_metrics(client)

        started = time.monotonic()
        await recorder.start()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        report.seconds = time.monotonic() - started
        report.gauges_end = await wait_idle(client)
        if server_pid is not None:
            report.rss_end = tree_rss_bytes(server_pid)
    report.window_size = recorder.size
    report.windows = recorder.windows
    for outcome in done:
        label = "cancelled" if outcome.cancelled else f"{outcome.kind} {outcome.status}"
        report.outcomes[label] += 1
        report.statuses["cancelled" if outcome.cancelled else str(outcome.status)] += 1
        if outcome.problem is not None:
            report.problems.append(f"{outcome.kind}: {outcome.problem}")
    return report


def verdict(report: Report, args: argparse.Namespace) -> list[str]:
    """The checks that failed (empty: the soak passed)."""
    failed = []
    if report.problems:
        failed.append(f"{len(report.problems)} unexpected outcomes, e.g. {report.problems[:3]}")
    if report.rss_after_warmup:
        growth = report.rss_end / report.rss_after_warmup - 1
        if growth >= args.max_rss_growth:
            failed.append(f"RSS grew {growth:.1%} after warm-up (limit {args.max_rss_growth:.0%})")
    end = report.gauges_end
    if "textgate_kv_cache_blocks_used" in end:
        total = kv_blocks_total(report.gauges_after_warmup)
        if (
            end["textgate_kv_cache_blocks_used"] != 0
            or end["textgate_kv_cache_blocks_free"] != total
        ):
            failed.append(f"KV allocator not idle: {end} (blocks in all: {total})")
    if end.get("tgi_batch_current_size", 0) or end.get("tgi_queue_size", 0):
        failed.append(f"batch or queue not empty: {end}")
    if report.p99_first and report.p99_last > args.max_p99_ratio * report.p99_first:
        failed.append(
            f"p99 s/token rose from {report.p99_first:.4f} to {report.p99_last:.4f} "
            f"(limit x{args.max_p99_ratio}); {drift_context(report)}"
        )
    return failed


def kv_blocks_total(gauges: dict[str, float]) -> float:
    """The allocator's blocks in all (used + free): its free count when idle."""
    return gauges.get("textgate_kv_cache_blocks_used", 0) + gauges.get(
        "textgate_kv_cache_blocks_free", 0
    )


def drift_context(report: Report) -> str:
    """What else changed between the first and last window: a slower machine raises the
    inference time per token and the load; a scheduler that queues too long raises the
    queue wait alone."""
    first, last = report.windows[0], report.windows[-1]
    parts = [f"load average {first.load_avg_1m:.1f} -> {last.load_avg_1m:.1f}"]
    if first.inference_s_per_token and last.inference_s_per_token:
        ratio = last.inference_s_per_token / first.inference_s_per_token
        parts.append(
            f"server inference s/token {first.inference_s_per_token:.3f} -> "
            f"{last.inference_s_per_token:.3f} (x{ratio:.2f})"
        )
    if first.mean_queue_s is not None and last.mean_queue_s is not None:
        parts.append(f"mean queue wait {first.mean_queue_s:.2f} -> {last.mean_queue_s:.2f} s")
    return ", ".join(parts)


def summary(report: Report, failed: list[str], command: list[str]) -> dict[str, Any]:
    return {
        "command": " ".join(command),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "requests": report.requests,
        "concurrency": report.concurrency,
        "seconds": round(report.seconds, 1),
        "statuses": dict(sorted(report.statuses.items())),
        "outcomes": dict(sorted(report.outcomes.items())),
        "unexpected": len(report.problems),
        "problems": report.problems[:20],
        "rss_after_warmup_mb": round(report.rss_after_warmup / 2**20, 1),
        "rss_end_mb": round(report.rss_end / 2**20, 1),
        "gauges_after_warmup": report.gauges_after_warmup,
        "gauges_end": report.gauges_end,
        "kv_blocks_total": kv_blocks_total(report.gauges_after_warmup),
        "p99_s_per_token_first": round(report.p99_first, 4),
        "p99_s_per_token_last": round(report.p99_last, 4),
        "window_size": report.window_size,
        "windows": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(w).items()}
            for w in report.windows
        ],
        "failed": failed,
    }


def markdown_rows(report: Report, failed: list[str], args: argparse.Namespace) -> str:
    """docs/reliability.md's soak table (check | result) and the per-window table."""

    def verdict_of(*checks: str) -> str:
        return "**fail**" if any(c in f for c in checks for f in failed) else "pass"

    def count(name: str) -> int:
        return report.statuses.get(name, 0)

    others = sorted(s for s in report.statuses if s not in ("200", "422", "cancelled"))
    other_text = "".join(f", {report.statuses[s]} × {s}" for s in others)
    end = report.gauges_end
    rss_growth = report.rss_end / report.rss_after_warmup - 1 if report.rss_after_warmup else 0.0
    ratio = report.p99_last / report.p99_first if report.p99_first else 0.0
    lines = [
        "| check | result |",
        "|---|---|",
        f"| outcomes | {report.requests:,} requests in {report.seconds:,.0f} s: "
        f"{count('200'):,} × 200, {count('422'):,} × 422 (deliberately invalid), "
        f"{count('cancelled'):,} cancelled{other_text}; "
        f"**{len(report.problems)} unexpected** |",
        (
            f"| RSS | {report.rss_after_warmup / 2**20:,.0f} MB after warm-up → "
            f"{report.rss_end / 2**20:,.0f} MB at the end ({rss_growth:+.1%}, limit "
            f"+{args.max_rss_growth:.0%}): {verdict_of('RSS')} |"
            if report.rss_after_warmup
            else "| RSS | not measured (a --url server's processes are not known) |"
        ),
        f"| KV allocator | {end.get('textgate_kv_cache_blocks_used', 0):,.0f} blocks used, "
        f"{end.get('textgate_kv_cache_blocks_free', 0):,.0f} free at the end "
        f"(idle count {kv_blocks_total(report.gauges_after_warmup):,.0f}); batch "
        f"{end.get('tgi_batch_current_size', 0):.0f}, queue {end.get('tgi_queue_size', 0):.0f}: "
        f"{verdict_of('KV allocator', 'batch or queue')} |",
        f"| p99 s/token | first {report.window_size:,} completions {report.p99_first:.3f} s, "
        f"last {report.windows[-1].requests if report.windows else 0:,}: "
        f"{report.p99_last:.3f} s (x{ratio:.2f}, limit x{args.max_p99_ratio}): "
        f"{verdict_of('p99')} |",
        "",
        "| window | requests | wall s | p99 s/token | mean queue s | inference s/token | load avg |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, w in enumerate(report.windows, 1):
        queue = "" if w.mean_queue_s is None else f"{w.mean_queue_s:.2f}"
        inference = "" if w.inference_s_per_token is None else f"{w.inference_s_per_token:.3f}"
        lines.append(
            f"| {number} | {w.requests:,} | {w.seconds:,.1f} | {w.p99_s_per_token:.3f} | "
            f"{queue} | {inference} | {w.load_avg_1m:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=int(os.environ.get("SOAK_REQUESTS", 5000)))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="soak a running server instead of starting the default model")
    parser.add_argument(
        "--launcher-args", default="", help="extra textgate-launcher flags, one string"
    )
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--max-p99-ratio", type=float, default=1.5)
    parser.add_argument("--output", type=Path, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    command = ["python -m textgate.bench.soak", *(sys.argv[1:] if argv is None else argv)]
    if args.url:
        report = asyncio.run(soak(args.url, None, args))
        server_log = None
    else:
        with launched_server(args.launcher_args.split()) as server:
            report = asyncio.run(soak(server.url, server.pid, args))
            server_log = str(server.log)
    failed = verdict(report, args)
    result = summary(report, failed, command) | {"server_log": server_log}
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    print(markdown_rows(report, failed, args), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
