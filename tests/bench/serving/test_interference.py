"""`python -m textgate.bench.serving.interference`: the window arithmetic on recorded
timestamps, and one short run against the fake server."""

from __future__ import annotations

import json

import pytest

from textgate.bench.serving import interference
from textgate.bench.serving.metrics import RequestOutcome


def stream(start: float, ttft: float, itl: list[float]) -> RequestOutcome:
    return RequestOutcome(
        success=True,
        output_tokens=len(itl) + 1,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
    )


def test_token_times_accumulate_from_the_first_token() -> None:
    times = interference.token_times(stream(10.0, 0.5, [0.1, 0.2]))
    assert times == pytest.approx([10.5, 10.6, 10.8])


def test_the_worst_gap_overlapping_the_long_prefill_against_the_undisturbed_p50() -> None:
    # Tokens every 100 ms from t=1.0; one 700 ms stall from t=2.0 to t=2.7.
    a = stream(0.0, 1.0, [0.1] * 10 + [0.7] + [0.1] * 10)
    # Tokens every 100 ms from t=1.05; a 500 ms stall from 2.05 to 2.55; ends at 2.75.
    b = stream(0.0, 1.05, [0.1] * 10 + [0.5] + [0.1] * 2)
    # The long prompt is sent at 2.1 and gets its first token at 2.6 (TTFT 500 ms).
    long = stream(2.1, 0.5, [0.05])
    result = interference.analyse([a, b], long)
    assert result.worst_gap_ms == pytest.approx(700.0)
    assert result.itl_p50_ms == pytest.approx(100.0)  # the stalls are in the window
    assert result.ratio == pytest.approx(7.0)
    assert result.long_ttft_ms == pytest.approx(500.0)
    assert (result.num_streams, result.num_streams_through) == (2, 2)


def test_a_gap_touching_the_window_only_at_its_edge_is_outside() -> None:
    # Gaps 1.0-1.1 (ends as the window opens) and 1.1-1.3 (inside).
    s = stream(0.0, 1.0, [0.1, 0.2, 0.1])
    result = interference.analyse([s], stream(1.1, 0.1, []))
    assert result.worst_gap_ms == pytest.approx(200.0)
    assert result.itl_p50_ms == pytest.approx(100.0)


def test_streams_that_end_before_the_window_closes_are_counted() -> None:
    early = stream(0.0, 1.0, [0.1, 0.1])  # last token at 1.2
    late = stream(0.0, 1.0, [0.1] * 20)
    result = interference.analyse([early, late], stream(1.15, 0.5, []))
    assert (result.num_streams, result.num_streams_through) == (2, 1)


def test_no_stream_in_the_window_and_failures_are_errors() -> None:
    done = stream(0.0, 1.0, [0.1])
    with pytest.raises(ValueError, match="no stream was decoding"):
        interference.analyse([done], stream(5.0, 0.5, []))
    failed = RequestOutcome(success=False, error="HTTP 422: too long")
    with pytest.raises(ValueError, match="HTTP 422: too long"):
        interference.analyse([done], failed)


@pytest.mark.parametrize("backend", ["tgi", "openai-completions"])
def test_a_short_run_against_the_fake_server(
    fake_server, tiny_tokenizer_dir, tmp_path, capsys, backend: str
) -> None:
    url, fake = fake_server
    fake.token_delay_s = 0.01
    out_file = tmp_path / "interference.jsonl"
    argv = [
        "--url", url,
        "--backend", backend,
        "--tokenizer", str(tiny_tokenizer_dir),
        "--streams", "3",
        "--input-len", "8",
        "--output-len", "40",
        "--long-prompt-tokens", "60",
        "--long-output-len", "4",
        "--settle-s", "0.05",
        "--rounds", "2",
        "--json-out", str(out_file),
    ]  # fmt: skip
    assert interference.main(argv) == 0
    assert "worst/p50" in capsys.readouterr().out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert (r["num_streams"], r["long_prompt_tokens"]) == (3, 60)
        assert r["num_streams_through"] == 3
        assert r["worst_gap_ms"] > 0 and r["itl_p50_ms"] > 0 and r["long_ttft_ms"] > 0
    # Per round: the streams' bodies, then the long prompt's, sent after they decoded.
    max_tokens = [b.get("max_tokens") or b["parameters"]["max_new_tokens"] for b in fake.bodies]
    assert max_tokens == [40, 40, 40, 4] * 2


def test_a_failing_server_exits_nonzero(fake_server, tiny_tokenizer_dir, capsys) -> None:
    url, _ = fake_server
    argv = ["--url", url + "/nope", "--tokenizer", str(tiny_tokenizer_dir), "--streams", "2",
            "--output-len", "4", "--long-prompt-tokens", "10", "--settle-s", "0"]  # fmt: skip
    assert interference.main(argv) == 1
    assert "HTTP 404" in capsys.readouterr().err
