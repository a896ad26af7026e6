"""`textgate-bench`: load-test a TGI or OpenAI-compatible streaming server.

    textgate-bench --url http://127.0.0.1:8080 --backend tgi --concurrency 1,4,16,32,64
    textgate-bench --url URL --request-rate 0.5,1,2 --num-requests 64
    textgate-bench --url URL_A --compare URL_B --concurrency 1,8
    textgate-bench --url URL --compare URL --grammar-json-schema bench/data/grammar_schema.json \
        --grammar-on B --concurrency 8        # unconstrained (A) vs JSON-constrained (B)

Prints a throughput table and a latency table (mean/p50/p90/p99 of TTFT, TPOT, ITL, E2E),
and with `--compare` the A/B ratios; `--json-out` appends one JSON line per run (`--requests-out`: per request) and
`--plot` writes a PNG. Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from textgate.bench.serving.backends import BACKENDS
from textgate.bench.serving.load import LoadLevel
from textgate.bench.serving.metrics import GoodputTargets
from textgate.bench.serving.report import (
    append_json_lines,
    compare_results,
    format_results,
    format_spread,
    request_records,
    result_record,
)
from textgate.bench.serving.runner import BenchConfig, RunResult, Target, run_benchmark
from textgate.bench.serving.tokenizer import load_tokenizer
from textgate.bench.serving.workload import add_workload_args, spec_from_args

T = TypeVar("T")


def parse_list(text: str, kind: Callable[[str], T]) -> list[T]:
    """`"1,4,16"` → `[1, 4, 16]` (with `kind=int`)."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list: {exc}") from exc


def build_parser() -> argparse.ArgumentParser:
    """The `textgate-bench` command line."""
    parser = argparse.ArgumentParser(
        prog="textgate-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (A)")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="tgi")
    parser.add_argument(
        "--model",
        default=None,
        help="OpenAI `model` (default: GET /v1/models); several, comma-separated (a base and "
        "its LoRA adapters, say): the requests take them in turn",
    )
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer`")
    parser.add_argument("--compare", metavar="URL2", default=None, help="second server (B)")
    parser.add_argument("--compare-backend", choices=sorted(BACKENDS), default=None)
    parser.add_argument("--compare-model", default=None)
    add_workload_args(parser)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="send no `ignore_eos` field; count what the server produced\n"
        "(needed for servers that reject unknown fields, e.g. `transformers serve`)",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency", default="1,8,32", help="closed loop: clients, a list = sweep"
    )
    load.add_argument(
        "--request-rate", default=None, help="open loop: Poisson req/s, a list = sweep"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap for open loop")
    load.add_argument(
        "--num-requests", type=int, default=None, help="per level (default: 2×C, at least 8)"
    )
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests per level")
    load.add_argument(
        "--rounds", type=int, default=None, help="per level (default 1; 2 with --compare)"
    )
    load.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    default = GoodputTargets()
    goodput = parser.add_argument_group(
        "goodput", "a request is good when it succeeds within both targets"
    )
    goodput.add_argument(
        "--goodput-ttft-ms",
        type=float,
        default=default.ttft_ms,
        help=f"longest TTFT of a good request (default {default.ttft_ms:g})",
    )
    goodput.add_argument(
        "--goodput-itl-ms",
        type=float,
        default=default.itl_ms,
        help="longest mean inter-token latency (TPOT) of a good request "
        f"(default {default.itl_ms:g})",
    )
    grammar = parser.add_argument_group("structured output")
    grammar.add_argument(
        "--grammar-json-schema",
        metavar="FILE",
        default=None,
        help="constrain every request to JSON matching this schema (tgi: parameters.grammar,\n"
        "openai-chat: response_format json_schema)",
    )
    grammar.add_argument(
        "--grammar-on",
        choices=["A", "B", "both"],
        default="both",
        help="which targets get the schema; with --compare <the same URL> and B, one run\n"
        "measures unconstrained vs constrained",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json-out", default=None, help="append one JSON line per run")
    out.add_argument(
        "--requests-out",
        default=None,
        help="append one JSON line per measured request (round, start, TTFT, worst gap)",
    )
    out.add_argument("--plot", default=None, help="write a PNG of the sweep")
    out.add_argument("--label", default="", help="free text stored in the JSON records")
    return parser


def levels_from_args(args: argparse.Namespace) -> tuple[LoadLevel, ...]:
    """Open-loop levels when `--request-rate` is given, else closed-loop ones."""
    if args.request_rate:
        return tuple(
            LoadLevel(request_rate=rate, max_concurrency=args.max_concurrency)
            for rate in parse_list(args.request_rate, float)
        )
    return tuple(LoadLevel(concurrency=c) for c in parse_list(args.concurrency, int))


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig the command line describes."""
    rounds = args.rounds if args.rounds is not None else (2 if args.compare else 1)
    return BenchConfig(
        workload=spec_from_args(args),
        levels=levels_from_args(args),
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        num_requests=args.num_requests,
        warmup=args.warmup,
        rounds=rounds,
        timeout_s=args.timeout,
        api_key=args.api_key,
        json_schema=_json_schema(args),
        grammar_on=("A", "B") if args.grammar_on == "both" else (args.grammar_on,),
        goodput=GoodputTargets(args.goodput_ttft_ms, args.goodput_itl_ms),
    )


def _json_schema(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --grammar-json-schema file's schema; ValueError when it is unusable."""
    if args.grammar_json_schema is None:
        return None
    backends = {args.backend, args.compare_backend or args.backend}
    if "openai-completions" in backends:
        raise ValueError("--grammar-json-schema needs the tgi or openai-chat backend")
    try:
        schema = json.loads(Path(args.grammar_json_schema).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--grammar-json-schema: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError("--grammar-json-schema: the file must hold a JSON schema object")
    return schema


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    """Target A, and B when `--compare` is given."""
    targets = [Target(args.url, args.backend, args.model, "A")]
    if args.compare:
        backend = args.compare_backend or args.backend
        targets.append(Target(args.compare, backend, args.compare_model or args.model, "B"))
    return targets


def run_context(args: argparse.Namespace, tokenizer_source: str) -> dict[str, Any]:
    """What every JSON record of this invocation shares."""
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "input_len_range": args.input_len_range,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "warmup": args.warmup,
        "tokenizer": tokenizer_source,
        "grammar_json_schema": args.grammar_json_schema,
        "grammar_on": args.grammar_on if args.grammar_json_schema else None,
    }


def report(results: Sequence[RunResult], args: argparse.Namespace, context: dict[str, Any]) -> None:
    """Print the tables (and ratios), then write the JSON lines and the plot if asked."""
    print(format_results(results))
    if spread := format_spread(results):
        print()
        print(spread)
    if args.compare:
        print()
        print(compare_results(results))
    if args.json_out:
        append_json_lines(args.json_out, [result_record(r, context) for r in results])
    if args.requests_out:
        append_json_lines(
            args.requests_out, [rec for r in results for rec in request_records(r, context)]
        )
    if args.plot:
        from textgate.bench.serving.plot import plot_results

        plot_results(results, args.plot)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark the command line describes; 0 when every request succeeded."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        build_parser().error(str(exc))
    tokenizer = load_tokenizer(args.tokenizer)
    results = asyncio.run(run_benchmark(targets_from_args(args), config, tokenizer))
    report(results, args, run_context(args, tokenizer.source))
    return 1 if any(r.metrics.failed for r in results) else 0
