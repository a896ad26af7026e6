"""Present results: text tables, A/B ratios, JSON lines and an optional PNG."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from textgate.bench.serving.metrics import BenchmarkMetrics, LatencyStats
from textgate.bench.serving.runner import RunResult

LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el"))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table; floats get two decimals, text is left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    left = [all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if lft else v.rjust(w)
            for v, w, lft in zip(values, widths, left, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def throughput_rows(named: Sequence[tuple[str, BenchmarkMetrics]]) -> list[list[Any]]:
    """One row per run: counts and throughputs."""
    return [
        [
            name,
            m.completed,
            m.failed,
            m.duration_s,
            m.request_throughput,
            m.output_throughput,
            m.total_token_throughput,
            100.0 * m.good_fraction,
            m.goodput,
        ]
        for name, m in named
    ]


THROUGHPUT_HEADERS = (
    "run",
    "ok",
    "failed",
    "dur_s",
    "req/s",
    "out_tok/s",
    "total_tok/s",
    "good %",
    "goodput req/s",
)


def goodput_note(metrics: BenchmarkMetrics) -> str:
    """The line saying which requests count as good."""
    t = metrics.goodput_targets
    return f"good: TTFT <= {t.ttft_ms:g} ms and TPOT (mean ITL) <= {t.itl_ms:g} ms"


def latency_rows(named: Sequence[tuple[str, BenchmarkMetrics]]) -> list[list[Any]]:
    """Four rows per run (TTFT, TPOT, ITL, E2E) with mean and percentiles in ms."""
    rows: list[list[Any]] = []
    for name, m in named:
        for i, (label, attr) in enumerate(LATENCIES):
            s: LatencyStats = getattr(m, attr)
            rows.append([name if i == 0 else "", label, s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms])
    return rows


LATENCY_HEADERS = ("run", "metric (ms)", "mean", "p50", "p90", "p99")


def format_metrics(named: Sequence[tuple[str, BenchmarkMetrics]]) -> str:
    """Throughput and latency tables for named runs, then the first error of each failing run."""
    parts = [
        format_table(THROUGHPUT_HEADERS, throughput_rows(named)),
        "",
        format_table(LATENCY_HEADERS, latency_rows(named)),
    ]
    errors = [
        f"{name}: {m.failed} failed; first error: {m.first_error}" for name, m in named if m.failed
    ]
    if errors:
        parts += ["", *errors]
    return "\n".join(parts)


def run_name(result: RunResult) -> str:
    """`A c=8` style label of a run."""
    return f"{result.target.name} {result.level.label}"


def format_results(results: Sequence[RunResult]) -> str:
    """The tables for benchmark results, with each target's URL above them."""
    targets = {r.target.name: r.target for r in results}
    header = [f"{name}: {t.url} ({t.backend})" for name, t in targets.items()]
    if results:
        header.append(goodput_note(results[0].metrics))
    return "\n".join([*header, "", format_metrics([(run_name(r), r.metrics) for r in results])])


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is zero (no sample)."""
    return a / b if b else float("nan")


RATIO_HEADERS = (
    "level",
    "req/s",
    "out_tok/s",
    "goodput",
    "TTFT p50",
    "TPOT p50",
    "ITL p50",
    "E2E p50",
    "E2E p99",
)


def ratio_row(label: str, a: BenchmarkMetrics, b: BenchmarkMetrics) -> list[Any]:
    """A/B ratios: throughputs (>1: A is faster) then latencies (<1: A is faster)."""
    return [
        label,
        ratio(a.request_throughput, b.request_throughput),
        ratio(a.output_throughput, b.output_throughput),
        ratio(a.goodput, b.goodput),
        ratio(a.ttft.p50_ms, b.ttft.p50_ms),
        ratio(a.tpot.p50_ms, b.tpot.p50_ms),
        ratio(a.itl.p50_ms, b.itl.p50_ms),
        ratio(a.e2el.p50_ms, b.e2el.p50_ms),
        ratio(a.e2el.p99_ms, b.e2el.p99_ms),
    ]


def format_ratios(rows: Sequence[Sequence[Any]], a_name: str = "A", b_name: str = "B") -> str:
    """The ratio table with a line saying how to read it."""
    note = f"ratios {a_name}/{b_name}: throughput > 1 and latency < 1 mean {a_name} is faster"
    return note + "\n" + format_table(RATIO_HEADERS, rows)


def compare_results(results: Sequence[RunResult]) -> str:
    """Ratio table between the first two targets of `results`, level by level."""
    names = list(dict.fromkeys(r.target.name for r in results))
    by_key = {(r.target.name, r.level): r for r in results}
    levels = list(dict.fromkeys(r.level for r in results))
    a, b = names[0], names[1]
    rows = [
        ratio_row(level.label, by_key[(a, level)].metrics, by_key[(b, level)].metrics)
        for level in levels
    ]
    return format_ratios(rows, a, b)


SPREAD_HEADERS = ("run", "out_tok/s", "TTFT p50", "TTFT p99", "ITL p50", "goodput req/s")


def spread_rows(results: Sequence[RunResult]) -> list[list[Any]]:
    """Per run, each round's headline numbers joined by " / ", in round order."""

    def each(values: Sequence[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)

    return [
        [
            run_name(r),
            each([m.output_throughput for m in r.round_metrics]),
            each([m.ttft.p50_ms for m in r.round_metrics]),
            each([m.ttft.p99_ms for m in r.round_metrics]),
            each([m.itl.p50_ms for m in r.round_metrics]),
            each([m.goodput for m in r.round_metrics]),
        ]
        for r in results
    ]


def format_spread(results: Sequence[RunResult]) -> str:
    """Each round's numbers side by side (latencies in ms), or "" with a single round."""
    if all(r.rounds < 2 for r in results):
        return ""
    return "per round:\n" + format_table(SPREAD_HEADERS, spread_rows(results))


def metrics_record(metrics: BenchmarkMetrics, context: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-ready dict: the run's context, then every metric (latencies nested, in ms)."""
    return {**context, **asdict(metrics)}


def result_record(result: RunResult, context: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON record of one benchmark run."""
    level = result.level
    return metrics_record(
        result.metrics,
        {
            **context,
            "target": result.target.name,
            "url": result.target.url,
            "backend": result.target.backend,
            "concurrency": level.concurrency,
            "request_rate": level.request_rate,
            "max_concurrency": level.max_concurrency,
            "rounds": result.rounds,
            "num_requests": len(result.outcomes),
            "per_round": [asdict(m) for m in result.round_metrics],
        },
    )


def request_records(result: RunResult, context: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One JSON record per measured request of `result`: its round, its start (seconds after
    the round's first request started) and what the client saw, times in milliseconds."""
    records: list[dict[str, Any]] = []
    begin = 0
    for round_index, size in enumerate(result.round_sizes):
        outcomes = result.outcomes[begin : begin + size]
        begin += size
        origin = min((o.start_time for o in outcomes), default=0.0)
        for index, o in enumerate(outcomes):
            records.append(
                {
                    **context,
                    "target": result.target.name,
                    "concurrency": result.level.concurrency,
                    "request_rate": result.level.request_rate,
                    "round": round_index + 1,
                    "index": index,
                    "success": o.success,
                    "start_s": round(o.start_time - origin, 6),
                    "prompt_len": o.prompt_len,
                    "output_tokens": o.output_tokens,
                    "ttft_ms": round(o.ttft * 1000, 3),
                    "itl_max_ms": round(max(o.itl, default=0.0) * 1000, 3),
                    "latency_ms": round(o.latency * 1000, 3),
                    "error": o.error,
                }
            )
    return records


def append_json_lines(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Append one JSON object per line to `path` (created when missing)."""
    with Path(path).open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
