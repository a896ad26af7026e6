from __future__ import annotations

import json
import math

from textgate.bench.serving.load import LoadLevel
from textgate.bench.serving.metrics import RequestOutcome, compute_metrics
from textgate.bench.serving.plot import plot_results
from textgate.bench.serving.report import (
    append_json_lines,
    compare_results,
    format_metrics,
    format_spread,
    format_table,
    ratio,
    request_records,
    result_record,
)
from textgate.bench.serving.runner import RunResult, Target


def ok(ttft: float, gap: float, n: int = 4) -> RequestOutcome:
    return RequestOutcome(True, 10, n, ttft, [gap] * (n - 1), ttft + gap * (n - 1))


def result(name: str, c: int, gap: float) -> RunResult:
    r = RunResult(Target(f"http://{name}", "tgi", None, name), LoadLevel(concurrency=c))
    r.add_round([ok(0.1, gap), ok(0.2, gap)], 1.0)
    return r


def test_format_table_aligns_columns() -> None:
    text = format_table(("name", "value"), [["a", 1.0], ["long name", 12.345]])
    lines = text.splitlines()
    assert lines[0] == "name       value"
    assert lines[2] == "a           1.00"
    assert lines[3] == "long name  12.35"


def test_format_metrics_shows_failures() -> None:
    bad = RequestOutcome(success=False, error="HTTP 503: unhealthy")
    text = format_metrics([("A c=1", compute_metrics([ok(0.1, 0.01), bad], 1.0))])
    assert "TTFT" in text and "E2E" in text
    assert "A c=1: 1 failed; first error: HTTP 503: unhealthy" in text


def test_rounds_pool_outcomes_and_durations() -> None:
    r = result("A", 1, 0.01)
    first = r.metrics.request_throughput
    r.add_round([ok(0.1, 0.01)], 2.0)
    assert r.rounds == 2
    assert r.metrics.completed == 3
    assert r.metrics.request_throughput == 3 / 3.0 != first


def test_each_rounds_numbers_are_kept_for_the_spread() -> None:
    r = result("A", 1, 0.01)
    assert format_spread([r]) == ""  # one round: nothing to spread
    r.add_round([ok(0.1, 0.01)], 2.0)
    assert [m.output_throughput for m in r.round_metrics] == [8.0, 2.0]
    text = format_spread([r])
    assert text.splitlines()[-1].split()[:5] == ["A", "c=1", "8.00", "/", "2.00"]
    record = result_record(r, {})
    assert [m["completed"] for m in record["per_round"]] == [2, 1]


def test_compare_ratios() -> None:
    results = [result("A", 1, 0.01), result("B", 1, 0.02)]
    text = compare_results(results)
    row = text.splitlines()[-1].split()
    assert row[0] == "c=1"
    assert float(row[1]) == 1.0  # same request throughput
    assert float(row[3]) == 1.0  # every request of both is good
    assert float(row[5]) == 0.5  # A's TPOT is half of B's
    assert math.isnan(ratio(1.0, 0.0))


def test_records_are_json_lines(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    append_json_lines(path, [result_record(result("A", 4, 0.01), {"label": "x"})])
    append_json_lines(path, [result_record(result("A", 8, 0.01), {"label": "y"})])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["label"], r["concurrency"], r["completed"]) for r in records] == [
        ("x", 4, 2), ("y", 8, 2)
    ]  # fmt: skip
    assert records[0]["tpot"]["p99_ms"] > 0


def test_request_records_keep_each_round_and_start_from_its_first_request() -> None:
    r = RunResult(Target("http://A", "tgi", None, "A"), LoadLevel(concurrency=2))
    late = RequestOutcome(True, 10, 3, 0.3, [0.01, 0.05], 0.36, start_time=100.5)
    r.add_round([ok(0.1, 0.01), late], 1.0)
    r.add_round([RequestOutcome(False, 10, start_time=7.0, error="HTTP 503")], 1.0)
    for o in r.outcomes[:1]:
        o.start_time = 100.0
    records = request_records(r, {"label": "x"})
    assert [(x["round"], x["index"], x["start_s"]) for x in records] == [
        (1, 0, 0.0), (1, 1, 0.5), (2, 0, 0.0)
    ]  # fmt: skip
    assert records[1]["ttft_ms"] == 300.0 and records[1]["itl_max_ms"] == 50.0
    assert records[2]["success"] is False and records[2]["error"] == "HTTP 503"
    assert {x["label"] for x in records} == {"x"} and records[0]["concurrency"] == 2


def test_plot_writes_a_png(tmp_path) -> None:
    results = [result(n, c, 0.01) for c in (1, 2, 4) for n in ("A", "B")]
    path = tmp_path / "plot.png"
    plot_results(results, path, {"naive": results[0].metrics})
    assert path.read_bytes().startswith(b"\x89PNG")
