"""`python -m textgate.bench.serving.tenants`: a light tenant beside a heavy one.

Issue 28's fairness claim, as a user would check it: a light tenant's time to first token
should barely move when another tenant floods the server. Each round:

1. **alone**: the light tenant's `--light-requests` requests, `--light-concurrency` at a
   time, nothing else running;
2. **together**: the same number of fresh light requests while the heavy tenant keeps
   `--heavy-concurrency` requests in flight (closed loop, from before the light ones
   start until they end).

Prints the light tenant's TTFT p50/p99 alone and together and their ratio (issue 28's goal:
p50 within 1.5x), the heavy tenant's TTFT p50 and both tenants' output tokens/s while
together. Without `--url` it starts textgate (`textgate-launcher`, extra flags in
`--textgate-args`) with a generated `--api-keys-file` of two tenants (`heavy`, `light`,
their `--heavy-weight` / `--light-weight`); with `--url`, give the two keys of a running
server's key file (`--heavy-key`, `--light-key`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from textgate.bench.serving.backends import BACKENDS, GenerationSettings, get_backend
from textgate.bench.serving.metrics import RequestOutcome, percentiles
from textgate.bench.serving.report import append_json_lines, format_table
from textgate.bench.serving.request import send_request
from textgate.bench.serving.runner import Target, resolve_model_name
from textgate.bench.serving.sweep import launcher_command, running_server
from textgate.bench.serving.tokenizer import BenchTokenizer, load_tokenizer
from textgate.bench.serving.workload import (
    BenchRequest,
    WorkloadSpec,
    add_workload_args,
    build_requests,
    spec_from_args,
)

HEAVY_KEY = "sk-bench-heavy"
LIGHT_KEY = "sk-bench-light"


@dataclass(frozen=True)
class TenantRound:
    """What one round measured (milliseconds, tokens/s)."""

    light_alone_ttft_p50_ms: float
    light_alone_ttft_p99_ms: float
    light_together_ttft_p50_ms: float
    light_together_ttft_p99_ms: float
    heavy_ttft_p50_ms: float
    light_tok_s: float
    heavy_tok_s: float
    failed: int

    @property
    def ratio(self) -> float:
        """Light TTFT p50 together ÷ alone (the goal: at most 1.5)."""
        return self.light_together_ttft_p50_ms / self.light_alone_ttft_p50_ms


def ttft_ms(outcomes: Sequence[RequestOutcome], percentile: float) -> float:
    """The `percentile` of the successful outcomes' TTFTs, in ms (nan when none succeeded)."""
    ttfts = [o.ttft for o in outcomes if o.success]
    if not ttfts:
        return float("nan")
    return percentiles(ttfts, (percentile,))[0] * 1e3


def key_file(folder: Path, heavy_weight: float, light_weight: float) -> Path:
    """A two-tenant `--api-keys-file` in `folder`."""
    path = folder / "bench-keys.json"
    keys = [
        {"key": HEAVY_KEY, "tenant": "heavy", "weight": heavy_weight},
        {"key": LIGHT_KEY, "tenant": "light", "weight": light_weight},
    ]
    path.write_text(json.dumps({"keys": keys}))
    return path


@dataclass
class Tenant:
    """One tenant's client and what it sends."""

    client: httpx.AsyncClient
    concurrency: int

    async def closed_loop(
        self,
        target: Target,
        settings: GenerationSettings,
        requests: Sequence[BenchRequest],
        tokenizer: BenchTokenizer,
        stop: asyncio.Event | None = None,
    ) -> list[RequestOutcome]:
        """Send `requests` `concurrency` at a time; with `stop`, cycle through them until it
        is set (each client ends its request in flight first)."""
        backend = get_backend(target.backend)
        outcomes: list[RequestOutcome] = []
        counter = iter(range(sys.maxsize))

        async def worker() -> None:
            for index in counter:
                if stop is None and index >= len(requests):
                    return
                if stop is not None and stop.is_set():
                    return
                request = requests[index % len(requests)]
                outcomes.append(
                    await send_request(
                        self.client, target.url, backend, request, settings, tokenizer.count
                    )
                )

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return outcomes


async def run_round(
    target: Target,
    settings: GenerationSettings,
    heavy: Tenant,
    light: Tenant,
    workload: WorkloadSpec,
    tokenizer: BenchTokenizer,
    light_requests: int,
    index: int,
) -> TenantRound:
    """One round: the light tenant alone, then beside the heavy tenant's closed loop."""
    alone = await light.closed_loop(
        target, settings, build_requests(workload, tokenizer, light_requests, 3 * index), tokenizer
    )
    stop = asyncio.Event()
    heavy_prompts = build_requests(workload, tokenizer, 4 * heavy.concurrency, 3 * index + 1)
    heavy_task = asyncio.create_task(
        heavy.closed_loop(target, settings, heavy_prompts, tokenizer, stop)
    )
    await asyncio.sleep(0.5)  # the heavy tenant's requests are in before the light ones
    light_prompts = build_requests(workload, tokenizer, light_requests, 3 * index + 2)
    start = time.perf_counter()
    together = await light.closed_loop(target, settings, light_prompts, tokenizer)
    elapsed = time.perf_counter() - start
    stop.set()
    heavy_outcomes = await heavy_task
    # Heavy requests that ended within the light tenant's window (an estimate of its rate).
    heavy_tokens = sum(
        o.output_tokens
        for o in heavy_outcomes
        if o.success and start <= o.start_time + o.latency <= start + elapsed
    )
    return TenantRound(
        light_alone_ttft_p50_ms=ttft_ms(alone, 50),
        light_alone_ttft_p99_ms=ttft_ms(alone, 99),
        light_together_ttft_p50_ms=ttft_ms(together, 50),
        light_together_ttft_p99_ms=ttft_ms(together, 99),
        heavy_ttft_p50_ms=ttft_ms(heavy_outcomes, 50),
        light_tok_s=sum(o.output_tokens for o in together if o.success) / elapsed,
        heavy_tok_s=heavy_tokens / elapsed,
        failed=sum(not o.success for o in (*alone, *together, *heavy_outcomes)),
    )


async def run_tenants(
    args: argparse.Namespace, url: str, heavy_key: str, light_key: str
) -> list[TenantRound]:
    """Every round against `url`."""
    tokenizer = load_tokenizer(args.tokenizer)
    workload = spec_from_args(args)
    timeout = httpx.Timeout(args.timeout)
    target = Target(url, args.backend, args.model)

    def client(key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {key}"})

    async with client(heavy_key) as heavy_client, client(light_key) as light_client:
        target = replace(target, model=await resolve_model_name(light_client, target))
        settings = GenerationSettings(args.output_len, args.ignore_eos, target.model or "tgi")
        heavy = Tenant(heavy_client, args.heavy_concurrency)
        light = Tenant(light_client, args.light_concurrency)
        rounds = []
        for index in range(args.rounds):
            print(f"[round {index + 1}]", file=sys.stderr, flush=True)
            rounds.append(
                await run_round(
                    target, settings, heavy, light, workload, tokenizer, args.light_requests, index
                )
            )
        return rounds


HEADERS = (
    "round",
    "light alone p50/p99 ms",
    "light together p50/p99 ms",
    "together/alone p50",
    "heavy TTFT p50 ms",
    "light tok/s",
    "heavy tok/s",
)


def format_rounds(rounds: Sequence[TenantRound]) -> str:
    """One row per round, then the median ratio."""
    rows = [
        [
            i + 1,
            f"{r.light_alone_ttft_p50_ms:.1f} / {r.light_alone_ttft_p99_ms:.1f}",
            f"{r.light_together_ttft_p50_ms:.1f} / {r.light_together_ttft_p99_ms:.1f}",
            round(r.ratio, 2),
            r.heavy_ttft_p50_ms,
            r.light_tok_s,
            r.heavy_tok_s,
        ]
        for i, r in enumerate(rounds)
    ]
    median = statistics.median(r.ratio for r in rounds)
    return format_table(HEADERS, rows) + f"\nmedian together/alone p50: {median:.2f}x"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.tenants",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default=None, help="a running server (else textgate starts)")
    parser.add_argument("--heavy-key", default=None, help="with --url: the heavy tenant's key")
    parser.add_argument("--light-key", default=None, help="with --url: the light tenant's key")
    parser.add_argument("--textgate-args", default="", help="extra textgate-launcher flags")
    parser.add_argument("--heavy-weight", type=float, default=1.0)
    parser.add_argument("--light-weight", type=float, default=1.0)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="openai-chat")
    parser.add_argument("--model", default=None)
    parser.add_argument("--heavy-concurrency", type=int, default=20)
    parser.add_argument("--light-concurrency", type=int, default=2)
    parser.add_argument("--light-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--json-out", default=None, help="append one JSON line per round")
    parser.add_argument("--label", default="")
    add_workload_args(parser)
    parser.set_defaults(dataset="conversations", output_len=64)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds; 1 when any request failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.heavy_concurrency, args.light_concurrency, args.light_requests, args.rounds) < 1:
        parser.error("concurrencies, --light-requests and --rounds must be >= 1")
    if args.url is not None and not (args.heavy_key and args.light_key):
        parser.error("--url needs --heavy-key and --light-key (its key file's)")
    if args.url is not None:
        rounds = asyncio.run(run_tenants(args, args.url, args.heavy_key, args.light_key))
    else:
        with tempfile.TemporaryDirectory(prefix="textgate-bench-keys-") as folder:
            keys = key_file(Path(folder), args.heavy_weight, args.light_weight)
            extra = ["--api-keys-file", str(keys), *shlex.split(args.textgate_args)]
            with running_server(launcher_command(extra)) as url:
                rounds = asyncio.run(run_tenants(args, url, HEAVY_KEY, LIGHT_KEY))
    print(
        f"light: {args.light_concurrency} at a time, {args.light_requests} per run; heavy: "
        f"{args.heavy_concurrency} in flight; {args.output_len} output tokens"
    )
    print(format_rounds(rounds))
    if args.json_out:
        context = {"label": args.label, **{k: getattr(args, k) for k in (
            "heavy_concurrency", "light_concurrency", "light_requests", "output_len",
            "heavy_weight", "light_weight")}}  # fmt: skip
        records = [{**context, **asdict(r), "ratio": r.ratio} for r in rounds]
        append_json_lines(args.json_out, records)
    return 1 if any(r.failed for r in rounds) else 0


if __name__ == "__main__":
    sys.exit(main())
