"""`python -m textgate.bench.serving.interference`: what one long prompt does to running streams.

1. `--streams` requests (short prompts, `--output-len` tokens each) start streaming.
2. Once every one of them has its first token, and `--settle-s` later, one long prompt of
   `--long-prompt-tokens` arrives (asking for `--long-output-len` tokens).
3. The window is the long prompt's prefill: from its send to its first token. A stream's
   gap between two tokens is in the window when it overlaps it.

Reported per round: the streams' ITL p50 over their gaps outside the window (undisturbed
decoding), their worst gap in the window, the ratio of the two (a server that chunks the
long prefill into its decode steps keeps it near 1; issue 32's goal is <= 4), and the
long prompt's TTFT. Streams that ended before the window closed are counted: when some
did, their worst gap may be understated (raise --output-len).

    python -m textgate.bench.serving.interference --url URL --streams 8 \\
        --long-prompt-tokens 2900 --output-len 160
    python -m textgate.bench.serving.interference --url VLLM_URL --backend openai-completions …

Every round uses fresh prompts (a prefix cache cannot replay the long one); speaks every
backend of `textgate-bench` (TGI's /generate_stream, OpenAI's completions and chat).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import httpx

from textgate.bench.serving.backends import BACKENDS, GenerationSettings, get_backend
from textgate.bench.serving.metrics import RequestOutcome, percentiles
from textgate.bench.serving.report import append_json_lines, format_table
from textgate.bench.serving.request import send_request
from textgate.bench.serving.runner import Target, log_stderr, resolve_model_name
from textgate.bench.serving.tokenizer import BenchTokenizer, load_tokenizer
from textgate.bench.serving.workload import (
    BenchRequest,
    WorkloadSpec,
    add_workload_args,
    build_requests,
    spec_from_args,
)


@dataclass(frozen=True)
class InterferenceResult:
    """One round: how the streams fared while the long prompt was prefilled (ms)."""

    itl_p50_ms: float
    """The streams' gaps outside the window, pooled."""
    worst_gap_ms: float
    """The longest of the streams' gaps overlapping the window."""
    ratio: float
    """worst_gap_ms / itl_p50_ms."""
    long_ttft_ms: float
    num_streams: int
    num_streams_through: int
    """Streams still decoding when the window closed."""


def token_times(outcome: RequestOutcome) -> list[float]:
    """Arrival times of a request's tokens (perf_counter seconds): first token, then each gap."""
    times = [outcome.start_time + outcome.ttft]
    for gap in outcome.itl:
        times.append(times[-1] + gap)
    return times


def analyse(streams: Sequence[RequestOutcome], long: RequestOutcome) -> InterferenceResult:
    """The round's numbers from the recorded streams and long prompt; ValueError when a
    request failed or no stream was decoding during the window."""
    failed = [o for o in (*streams, long) if not o.success]
    if failed:
        raise ValueError(f"{len(failed)} request(s) failed; first error: {failed[0].error}")
    opens, closes = long.start_time, long.start_time + long.ttft
    inside: list[float] = []
    outside: list[float] = []
    through = 0
    for stream in streams:
        times = token_times(stream)
        through += times[-1] >= closes
        for begin, end in itertools.pairwise(times):
            (inside if end > opens and begin < closes else outside).append(end - begin)
    if not inside:
        raise ValueError("no stream was decoding while the long prompt was prefilled")
    (p50,) = percentiles(outside, [50.0])
    worst = max(inside)
    return InterferenceResult(
        itl_p50_ms=p50 * 1e3,
        worst_gap_ms=worst * 1e3,
        ratio=worst / p50 if p50 else float("nan"),
        long_ttft_ms=long.ttft * 1e3,
        num_streams=len(streams),
        num_streams_through=through,
    )


@dataclass(frozen=True)
class Scenario:
    """What one round sends."""

    target: Target
    streams: GenerationSettings
    long: GenerationSettings
    settle_s: float = 1.0


async def _decoding(first_token: asyncio.Event, stream: asyncio.Task[RequestOutcome]) -> None:
    """Wait until the stream has its first token, or has ended without one."""
    waiter = asyncio.ensure_future(first_token.wait())
    await asyncio.wait({waiter, stream}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


async def run_round(
    client: httpx.AsyncClient,
    scenario: Scenario,
    streams: Sequence[BenchRequest],
    long: BenchRequest,
    tokenizer: BenchTokenizer,
) -> tuple[list[RequestOutcome], RequestOutcome]:
    """Start the streams, send the long prompt once they all decode, wait for everything."""
    url, backend = scenario.target.url, get_backend(scenario.target.backend)
    events = [asyncio.Event() for _ in streams]
    tasks = [
        asyncio.create_task(
            send_request(client, url, backend, r, scenario.streams, tokenizer.count, event)
        )
        for r, event in zip(streams, events, strict=True)
    ]
    await asyncio.gather(*(_decoding(e, t) for e, t in zip(events, tasks, strict=True)))
    await asyncio.sleep(scenario.settle_s)
    long_outcome = await send_request(client, url, backend, long, scenario.long, tokenizer.count)
    return list(await asyncio.gather(*tasks)), long_outcome


async def run_interference(
    scenario: Scenario,
    workload: WorkloadSpec,
    long_prompt_tokens: int,
    num_streams: int,
    rounds: int,
    tokenizer: BenchTokenizer,
    timeout_s: float = 600.0,
) -> list[InterferenceResult]:
    """`rounds` rounds, each with fresh prompts; one InterferenceResult each."""
    long_workload = replace(workload, dataset="synthetic", input_len=long_prompt_tokens)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        model = await resolve_model_name(client, scenario.target)
        scenario = replace(
            scenario,
            streams=replace(scenario.streams, model=model),
            long=replace(scenario.long, model=model),
        )
        results = []
        for index in range(rounds):
            streams = build_requests(workload, tokenizer, num_streams, stream=2 * index)
            (long,) = build_requests(long_workload, tokenizer, 1, stream=2 * index + 1)
            log_stderr(
                f"[round {index + 1}] {num_streams} streams, then {long.prompt_len} prompt tokens"
            )
            outcomes, long_outcome = await run_round(client, scenario, streams, long, tokenizer)
            results.append(analyse(outcomes, long_outcome))
        return results


HEADERS = (
    "round",
    "streams",
    "through",
    "ITL p50 ms",
    "worst gap ms",
    "worst/p50",
    "long TTFT ms",
)


def format_results(results: Sequence[InterferenceResult]) -> str:
    """One row per round."""
    rows = [
        [
            i + 1,
            r.num_streams,
            r.num_streams_through,
            r.itl_p50_ms,
            r.worst_gap_ms,
            r.ratio,
            r.long_ttft_ms,
        ]
        for i, r in enumerate(results)
    ]
    return format_table(HEADERS, rows)


def build_parser() -> argparse.ArgumentParser:
    """The command line of the interference scenario."""
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.interference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="tgi")
    parser.add_argument("--model", default=None, help="OpenAI `model` (default: GET /v1/models)")
    parser.add_argument("--streams", type=int, default=8, help="requests decoding")
    parser.add_argument("--long-prompt-tokens", type=int, default=2900)
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument(
        "--settle-s", type=float, default=1.0, help="decode time before the long prompt"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--json-out", default=None, help="append one JSON line per round")
    parser.add_argument("--label", default="", help="free text stored in the JSON records")
    add_workload_args(parser)
    parser.set_defaults(input_len=40, output_len=160)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenario; 1 when a request failed or no stream overlapped the long prefill."""
    args = build_parser().parse_args(argv)
    if args.streams < 1 or args.rounds < 1 or args.long_prompt_tokens < 1:
        build_parser().error("--streams, --rounds and --long-prompt-tokens must be >= 1")
    scenario = Scenario(
        Target(args.url, args.backend, args.model),
        GenerationSettings(args.output_len, args.ignore_eos),
        GenerationSettings(args.long_output_len, args.ignore_eos),
        args.settle_s,
    )
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        results = asyncio.run(
            run_interference(
                scenario,
                spec_from_args(args),
                args.long_prompt_tokens,
                args.streams,
                args.rounds,
                tokenizer,
                args.timeout,
            )
        )
    except ValueError as exc:
        print(f"interference: {exc}", file=sys.stderr)
        return 1
    print(f"{args.url} ({args.backend}): {args.streams} streams × {args.output_len} tokens")
    print(format_results(results))
    if args.json_out:
        context = {
            "label": args.label,
            "url": args.url,
            "backend": args.backend,
            "streams": args.streams,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "long_prompt_tokens": args.long_prompt_tokens,
        }
        append_json_lines(args.json_out, [{**context, **asdict(r)} for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
