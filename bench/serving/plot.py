"""PNG charts of a sweep: throughput and latency percentiles against the load level."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from textgate.bench.serving.metrics import BenchmarkMetrics
from textgate.bench.serving.runner import RunResult

_LATENCY_LINES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2el"))


def plot_results(
    results: Sequence[RunResult],
    path: str | Path,
    baselines: Mapping[str, BenchmarkMetrics] | None = None,
) -> None:
    """Write a two-panel PNG: output tok/s per level, and p50/p99 latencies per level.

    `baselines` (e.g. the naive one-request-at-a-time run) are drawn as horizontal lines.
    """
    # The Agg canvas renders without a display and without touching pyplot's global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    throughput_ax, latency_ax = fig.subplots(1, 2)
    open_loop = any(r.level.concurrency is None for r in results)
    xlabel = "request rate (req/s)" if open_loop else "concurrency"
    for name in dict.fromkeys(r.target.name for r in results):
        runs = sorted((r for r in results if r.target.name == name), key=lambda r: r.level.x_value)
        xs = [r.level.x_value for r in runs]
        label = f"{name} ({runs[0].target.url})"
        throughput_ax.plot(xs, [r.metrics.output_throughput for r in runs], "o-", label=label)
        for text, attr in _LATENCY_LINES:
            for pct, style in (("p50", "o-"), ("p99", "x--")):
                ys = [getattr(getattr(r.metrics, attr), f"{pct}_ms") for r in runs]
                latency_ax.plot(xs, ys, style, label=f"{name} {text} {pct}")
    for name, metrics in (baselines or {}).items():
        label = f"{name} ({metrics.output_throughput:.1f} tok/s)"
        throughput_ax.axhline(metrics.output_throughput, linestyle=":", color="gray", label=label)
    throughput_ax.set(xlabel=xlabel, ylabel="output tokens/s", title="Output token throughput")
    latency_ax.set(xlabel=xlabel, ylabel="ms", title="Latency percentiles", yscale="log")
    levels = sorted({r.level.x_value for r in results})
    for ax in (throughput_ax, latency_ax):
        if not open_loop:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{x:g}" for x in levels])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(str(path), dpi=100)
