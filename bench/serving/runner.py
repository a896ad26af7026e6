"""Run a benchmark: every load level against every target, targets taking turns.

With two targets (`--compare`) each level runs as A, B, A, B, … (`rounds` times each),
so slow drifts of a shared machine (thermal, other tenants) hit both servers alike. Each
round sends a fresh, reproducible prompt set — the same one to both targets — so a
server's prefix cache cannot profit from prompts it saw in an earlier round. Rounds of
one target at one level are pooled: outcomes are concatenated and durations summed.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx

from textgate.bench.serving.backends import GenerationSettings, get_backend
from textgate.bench.serving.load import LoadLevel, SendFn, run_closed_loop, run_load
from textgate.bench.serving.metrics import (
    BenchmarkMetrics,
    GoodputTargets,
    RequestOutcome,
    compute_metrics,
)
from textgate.bench.serving.request import send_request
from textgate.bench.serving.tokenizer import BenchTokenizer
from textgate.bench.serving.workload import BenchRequest, WorkloadSpec, build_requests

Log = Callable[[str], None]


def log_stderr(message: str) -> None:
    """Progress goes to stderr so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Target:
    """A server to benchmark."""

    url: str
    backend: str = "tgi"
    model: str | None = None  # the OpenAI `model` field; None = ask GET /v1/models
    name: str = "A"


@dataclass(frozen=True)
class BenchConfig:
    """Everything about a benchmark except where it is sent."""

    workload: WorkloadSpec
    levels: tuple[LoadLevel, ...]
    output_len: int = 64
    ignore_eos: bool = True
    num_requests: int | None = None  # per level and round; None = level.default_num_requests()
    warmup: int = 2
    rounds: int = 1
    timeout_s: float = 600.0
    api_key: str | None = None
    json_schema: dict[str, Any] | None = None
    """Structured output: every request of the `grammar_on` targets asks for JSON matching it."""
    grammar_on: tuple[str, ...] = ("A", "B")
    """Target names whose requests carry `json_schema`."""
    goodput: GoodputTargets = field(default_factory=GoodputTargets)
    """The latency targets a good request meets."""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("at least one load level is needed")
        if self.output_len < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError("output_len and rounds must be >= 1, warmup >= 0")


@dataclass
class RunResult:
    """The pooled outcomes of one target at one load level."""

    target: Target
    level: LoadLevel
    outcomes: list[RequestOutcome] = field(default_factory=list)
    duration_s: float = 0.0
    rounds: int = 0
    goodput: GoodputTargets = field(default_factory=GoodputTargets)
    round_metrics: list[BenchmarkMetrics] = field(default_factory=list)
    """Each round on its own, for the spread between rounds."""
    round_sizes: list[int] = field(default_factory=list)
    """How many of `outcomes` each round added, in order."""

    def add_round(self, outcomes: Sequence[RequestOutcome], duration_s: float) -> None:
        """Pool one more round into this result."""
        self.round_metrics.append(compute_metrics(outcomes, duration_s, self.goodput))
        self.round_sizes.append(len(outcomes))
        self.outcomes.extend(outcomes)
        self.duration_s += duration_s
        self.rounds += 1
        self.__dict__.pop("metrics", None)

    @cached_property
    def metrics(self) -> BenchmarkMetrics:
        """The metrics of all rounds pooled."""
        return compute_metrics(self.outcomes, self.duration_s, self.goodput)


async def resolve_model_name(client: httpx.AsyncClient, target: Target) -> str:
    """The `model` field to send: the target's, else the server's first model, else "tgi"."""
    if target.model is not None:
        return target.model
    try:
        response = await client.get(target.url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        # TGI's OpenAI routes accept any model name; "tgi" is what its docs use.
        return "tgi"


async def run_benchmark(
    targets: Sequence[Target],
    config: BenchConfig,
    tokenizer: BenchTokenizer,
    log: Log = log_stderr,
) -> list[RunResult]:
    """Run every level of `config` against every target; results ordered by level, target."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        settings = {}
        for t in targets:
            model = await resolve_model_name(client, t)
            schema = config.json_schema if t.name in config.grammar_on else None
            settings[t.name] = GenerationSettings(
                config.output_len, config.ignore_eos, model, json_schema=schema
            )
        session = _Session(client, config, tokenizer, settings, log)
        results: list[RunResult] = []
        for level_index, level in enumerate(config.levels):
            results.extend(await session.run_level(targets, level, level_index))
        return results


@dataclass
class _Session:
    """What every round of one benchmark shares."""

    client: httpx.AsyncClient
    config: BenchConfig
    tokenizer: BenchTokenizer
    settings: dict[str, GenerationSettings]
    log: Log

    async def run_level(
        self, targets: Sequence[Target], level: LoadLevel, level_index: int
    ) -> list[RunResult]:
        """All rounds of one level, the targets taking turns within each round."""
        config = self.config
        results = [RunResult(t, level, goodput=config.goodput) for t in targets]
        num = config.num_requests or level.default_num_requests()
        for round_index in range(config.rounds):
            stream = level_index * config.rounds + round_index
            requests = build_requests(config.workload, self.tokenizer, config.warmup + num, stream)
            for result in results:
                self.log(
                    f"[{result.target.name} {level.label} round {round_index + 1}] {num} requests"
                )
                outcomes, duration = await self.run_round(result.target, level, requests)
                result.add_round(outcomes, duration)
                failed = sum(not o.success for o in outcomes)
                self.log(f"  done in {duration:.1f}s, {failed} failed")
        return results

    async def run_round(
        self, target: Target, level: LoadLevel, requests: list[BenchRequest]
    ) -> tuple[list[RequestOutcome], float]:
        """Warm up on the first `warmup` requests, then measure the rest at `level`."""
        warmup, measured = requests[: self.config.warmup], requests[self.config.warmup :]
        if warmup:
            clients = level.concurrency or len(warmup)
            await run_closed_loop(len(warmup), clients, self.sender(target, warmup))
        seed = self.config.workload.seed
        return await run_load(level, len(measured), self.sender(target, measured), seed)

    def sender(self, target: Target, batch: list[BenchRequest]) -> SendFn:
        """A SendFn streaming `batch[index]` from `target`."""
        backend = get_backend(target.backend)
        settings = self.settings[target.name]
        # Several models (LoRA adapters, say), comma-separated: the requests take them in turn.
        each = [dataclasses.replace(settings, model=name) for name in settings.model.split(",")]

        async def send(index: int) -> RequestOutcome:
            return await send_request(
                self.client,
                target.url,
                backend,
                batch[index],
                each[index % len(each)],
                self.tokenizer.count,
            )

        return send
