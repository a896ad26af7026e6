"""textgate-bench against the real server (`live_server` starts the launcher, embedded model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from textgate.bench.serving.cli import main


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("backend", "dataset"),
    [("tgi", "synthetic"), ("openai-completions", "synthetic"), ("openai-chat", "conversations")],
)
def test_bench_against_live_server(
    live_server: str,
    backend: str,
    dataset: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = tmp_path / "runs.jsonl"
    argv = [
        "--url", live_server,
        "--backend", backend,
        "--dataset", dataset,
        "--concurrency", "1,2",
        "--num-requests", "3",
        "--warmup", "1",
        "--input-len", "16",
        "--output-len", "8",
        "--json-out", str(runs),
    ]  # fmt: skip
    code = main(argv)
    assert code == 0, capsys.readouterr().out
    records = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [r["concurrency"] for r in records] == [1, 2]
    for r in records:
        assert (r["completed"], r["failed"]) == (3, 0)
        assert r["total_output_tokens"] == 3 * 8  # ignore_eos forces the length
        assert r["ttft"]["p50_ms"] > 0
        assert r["tpot"]["p50_ms"] > 0
        assert r["output_throughput"] > 0
