"""Soak: many mixed requests against a real launcher; nothing lost, nothing leaks.

    python -m textgate.bench.soak --requests 5000            # starts the default model
    python -m textgate.bench.soak --url http://host:8080     # an already running server

Requests are drawn at random (seeded): /generate, /generate_stream, /v1/chat/completions
and /v1/completions, streamed or not, with random sampling parameters and lengths; a
share are deliberately invalid (each must get 422) and a share are cancelled by their
client (mid-stream, or before the answer). They run `--concurrency` at a time. At the end:

- zero unexpected outcomes (a 5xx, a 429 under the admission limit, an error event, a
  stream without its final event, an invalid request not answered 422, a hang);
- RSS of the server's processes (launcher, router, shards) grew < `--max-rss-growth`
  between the end of warm-up and the end;
- the KV allocator is idle again: no block used, the free-block count exactly what it
  was after warm-up, no running batch, an empty queue (from /metrics);
- p99 latency per generated token of the last window is within `--max-p99-ratio` of
  the first window's (windows of 1,000 requests, or a fifth of the run if smaller).

Prints a JSON summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from textgate.bench.sweep import free_port, launcher_command, stop_process, wait_healthy

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "Explain continuous batching in one sentence.",
    "café naïve 東京 🙂 — unicode survives",
    "def fibonacci(n):",
]
CANCEL_SHARE = 0.10
INVALID_SHARE = 0.05
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    kind: str
    status: int
    seconds: float
    tokens: int = 0
    cancelled: bool = False
    problem: str | None = None
    """Why this outcome was unexpected; None when it was as it should be."""


@dataclass
class Plan:
    kind: str
    path: str
    body: dict[str, Any]
    stream: bool
    invalid: bool = False
    cancel_after_s: float | None = None
    """Cancel the request after this long (streams: after their first event)."""


def plan_request(rng: random.Random) -> Plan:
    """One random request (route, streaming, sampling, length; maybe invalid or cancelled)."""
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(1, 24)
    stream = rng.random() < 0.5
    sampled = rng.random() < 0.5
    kind = rng.choice(("generate", "chat", "completions"))
    if kind == "generate":
        parameters: dict[str, Any] = {"max_new_tokens": max_tokens, "details": rng.random() < 0.5}
        if sampled:
            parameters |= {
                "do_sample": True,
                "temperature": round(rng.uniform(0.3, 1.5), 2),
                "top_p": round(rng.uniform(0.5, 0.99), 2),
                "top_k": rng.randint(1, 50),
                "seed": rng.randint(0, 2**31),
            }
        if rng.random() < 0.2:
            parameters["stop"] = [rng.choice([".", "\n", " the"])]
        body: dict[str, Any] = {"inputs": prompt, "parameters": parameters}
        path = "/generate_stream" if stream else "/generate"
    else:
        body = {"max_tokens": max_tokens, "stream": stream, "temperature": 0.0}
        if sampled:
            body |= {"temperature": round(rng.uniform(0.3, 1.5), 2), "seed": rng.randint(0, 2**31)}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
    plan = Plan(f"{kind}{'-stream' if stream else ''}", path, body, stream)
    draw = rng.random()
    if draw < INVALID_SHARE:
        plan.invalid = True
        # Each breaks one rule TGI and OpenAI servers reject (a string for an int, a
        # negative temperature, a zero length).
        if kind == "generate":
            body["parameters"]["max_new_tokens"] = rng.choice(["5", 0, -1])
        else:
            body["max_tokens"] = rng.choice(["5", -1])
    elif draw < INVALID_SHARE + CANCEL_SHARE:
        plan.cancel_after_s = rng.uniform(0.0, 0.5)
    return plan


async def run_one(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    started = time.monotonic()
    try:
        if plan.cancel_after_s is not None and not plan.stream:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.post(plan.path, json=plan.body), plan.cancel_after_s)
            return Outcome(plan.kind, 0, time.monotonic() - started, cancelled=True)
        if plan.stream:
            return await _stream(client, plan, started)
        response = await client.post(plan.path, json=plan.body)
        outcome = Outcome(plan.kind, response.status_code, time.monotonic() - started)
        outcome.problem = _check_answer(plan, response.status_code, response.text)
        if outcome.problem is None and not plan.invalid:
            outcome.tokens = _count_tokens(plan, response.json())
        return outcome
    except httpx.HTTPError as exc:
        return Outcome(
            plan.kind, 0, time.monotonic() - started, problem=f"{type(exc).__name__}: {exc}"
        )


async def _stream(client: httpx.AsyncClient, plan: Plan, started: float) -> Outcome:
    async with client.stream("POST", plan.path, json=plan.body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode()
            outcome = Outcome(plan.kind, response.status_code, time.monotonic() - started)
            outcome.problem = _check_answer(plan, response.status_code, text)
            return outcome
        events: list[str] = []
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            if plan.cancel_after_s is not None:
                await asyncio.sleep(plan.cancel_after_s)
                return Outcome(plan.kind, 200, time.monotonic() - started, cancelled=True)
    outcome = Outcome(plan.kind, 200, time.monotonic() - started)
    if plan.invalid:
        outcome.problem = "an invalid request was streamed"
    elif any('"error"' in event and "error_type" in event for event in events):
        outcome.problem = f"error event: {events[-1][:300]}"
    elif plan.kind == "generate-stream":
        last = json.loads(events[-1]) if events else {}
        outcome.tokens = len(events)
        if last.get("generated_text") is None:
            outcome.problem = "stream ended without its final event"
    else:
        outcome.tokens = len(events) - 1
        if not events or events[-1] != "[DONE]":
            outcome.problem = "stream ended without data: [DONE]"
    return outcome


def _check_answer(plan: Plan, status: int, text: str) -> str | None:
    if plan.invalid:
        return None if status == 422 else f"invalid request answered {status}: {text[:300]}"
    if status != 200:
        return f"{status}: {text[:300]}"
    return None


def _count_tokens(plan: Plan, body: Any) -> int:
    if plan.kind == "generate":
        details = body.get("details")
        return (
            int(details["generated_tokens"])
            if details
            else int(plan.body["parameters"]["max_new_tokens"])
        )
    return int(body["usage"]["completion_tokens"])


# ---- the server: its processes' memory, its allocator ----


def tree_rss_bytes(root_pid: int) -> int:
    """Resident memory of `root_pid` and all its descendants (launcher, router, shards)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # After the command name (which may hold spaces): state, then the parent's pid.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss[int(entry.name)] = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    tree = {root_pid}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(rss.get(pid, 0) for pid in tree)


async def read_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    names = (
        "textgate_kv_cache_blocks_used",
        "textgate_kv_cache_blocks_free",
        "tgi_batch_current_size",
        "tgi_queue_size",
    )
    gauges = {}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            gauges[name] = float(value)
    return gauges


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 10.0) -> dict[str, float]:
    """The gauges once nothing is used, running or queued (or as they are at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = await read_gauges(client)
        busy = [
            gauges.get(n, 0)
            for n in ("textgate_kv_cache_blocks_used", "tgi_batch_current_size", "tgi_queue_size")
        ]
        if not any(busy) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.1)


@contextlib.contextmanager
def launched_server(extra_args: list[str]) -> Iterator[tuple[str, int]]:
    """A launcher (default model) on a free port: its URL and pid."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="textgate-soak-", suffix=".log")[1])
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            launcher_command(extra_args)(port),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"soak: launcher pid {process.pid}, log {log_path}", file=sys.stderr)
    try:
        wait_healthy(url, process, log_path, timeout_s=900)
        yield url, process.pid
    finally:
        stop_process(process)


# ---- the run ----


@dataclass
class Report:
    requests: int
    concurrency: int
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    rss_after_warmup: int = 0
    rss_end: int = 0
    gauges_after_warmup: dict[str, float] = field(default_factory=dict)
    gauges_end: dict[str, float] = field(default_factory=dict)
    p99_first: float = 0.0
    p99_last: float = 0.0
    window: int = 0


async def soak(url: str, server_pid: int | None, args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    plans = [plan_request(rng) for _ in range(args.requests)]
    warmup = max(1, min(args.requests // 10, 500))
    report = Report(args.requests, args.concurrency)
    outcomes: list[Outcome | None] = [None] * len(plans)
    next_index = 0
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(plans):
                index = next_index
                next_index += 1
                outcomes[index] = await run_one(client, plans[index])
                if index == warmup - 1:
                    await mark_warm()

        async def mark_warm() -> None:
            if server_pid is not None:
                report.rss_after_warmup = tree_rss_bytes(server_pid)
            report.gauges_after_warmup = await read_gauges(client)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        report.seconds = time.monotonic() - started
        report.gauges_after_warmup = report.gauges_after_warmup or await read_gauges(client)
        # The free-block count after warm-up is taken while requests run; the idle
        # baseline is the total (used + free) the allocator reports.
        report.gauges_end = await wait_idle(client)
        if server_pid is not None:
            report.rss_end = tree_rss_bytes(server_pid)
    done = [o for o in outcomes if o is not None]
    for outcome in done:
        label = "cancelled" if outcome.cancelled else f"{outcome.kind} {outcome.status}"
        report.outcomes[label] += 1
        if outcome.problem is not None:
            report.problems.append(f"{outcome.kind}: {outcome.problem}")
    per_token = [o.seconds / o.tokens for o in done if o.tokens > 0 and o.problem is None]
    report.window = min(1000, max(1, len(per_token) // 5))
    report.p99_first = _p99(per_token[: report.window])
    report.p99_last = _p99(per_token[-report.window :])
    return report


def _p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def verdict(report: Report, args: argparse.Namespace) -> list[str]:
    """The checks that failed (empty: the soak passed)."""
    failed = []
    if report.problems:
        failed.append(f"{len(report.problems)} unexpected outcomes, e.g. {report.problems[:3]}")
    if report.rss_after_warmup:
        growth = report.rss_end / report.rss_after_warmup - 1
        if growth >= args.max_rss_growth:
            failed.append(f"RSS grew {growth:.1%} after warm-up (limit {args.max_rss_growth:.0%})")
    end, warm = report.gauges_end, report.gauges_after_warmup
    if "textgate_kv_cache_blocks_used" in end:
        total = warm.get("textgate_kv_cache_blocks_used", 0) + warm.get(
            "textgate_kv_cache_blocks_free", 0
        )
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
            f"(limit x{args.max_p99_ratio})"
        )
    return failed


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
    args = parser.parse_args(argv)
    if args.url:
        report = asyncio.run(soak(args.url, None, args))
    else:
        with launched_server(args.launcher_args.split()) as (url, server_pid):
            report = asyncio.run(soak(url, server_pid, args))
    failed = verdict(report, args)
    summary = {
        "requests": report.requests,
        "concurrency": report.concurrency,
        "seconds": round(report.seconds, 1),
        "outcomes": dict(sorted(report.outcomes.items())),
        "unexpected": len(report.problems),
        "rss_after_warmup_mb": round(report.rss_after_warmup / 2**20, 1),
        "rss_end_mb": round(report.rss_end / 2**20, 1),
        "gauges_after_warmup": report.gauges_after_warmup,
        "gauges_end": report.gauges_end,
        "p99_s_per_token_first": round(report.p99_first, 4),
        "p99_s_per_token_last": round(report.p99_last, 4),
        "latency_window": report.window,
        "failed": failed,
    }
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
