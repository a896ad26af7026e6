"""End to end: the `textgate-bench` CLI runs tiny sweeps against the fake server."""

from __future__ import annotations

import json

import pytest

from textgate.bench.serving.cli import build_parser, levels_from_args, main
from textgate.bench.serving.load import LoadLevel


def common_args(url: str, tokenizer_dir, tmp_path) -> list[str]:
    return [
        "--url", url,
        "--tokenizer", str(tokenizer_dir),
        "--input-len", "12",
        "--output-len", "5",
        "--num-requests", "4",
        "--warmup", "1",
        "--json-out", str(tmp_path / "runs.jsonl"),
    ]  # fmt: skip


@pytest.mark.parametrize("backend", ["tgi", "openai-completions", "openai-chat"])
def test_tiny_sweep(fake_server, tiny_tokenizer_dir, tmp_path, capsys, backend: str) -> None:
    url, fake = fake_server
    argv = [
        *common_args(url, tiny_tokenizer_dir, tmp_path),
        "--backend", backend,
        "--concurrency", "1,2",
        "--plot", str(tmp_path / "sweep.png"),
    ]  # fmt: skip
    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "A c=1" in out and "A c=2" in out and "TPOT" in out
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["concurrency"] for r in records] == [1, 2]
    for r in records:
        assert (r["completed"], r["failed"], r["backend"]) == (4, 0, backend)
        assert r["total_output_tokens"] == 20
        assert r["output_len"] == 5 and r["input_len"] == 12
        assert set(r["ttft"]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
        assert r["tpot"]["mean_ms"] > 0
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert len(fake.bodies) == 2 * (1 + 4)  # warmup + measured, per level
    if backend != "tgi":
        assert {b["model"] for b in fake.bodies} == {"fake-model"}


def test_open_loop_and_conversations(fake_server, tiny_tokenizer_dir, tmp_path, capsys) -> None:
    url, fake = fake_server
    argv = [
        *common_args(url, tiny_tokenizer_dir, tmp_path),
        "--backend", "openai-chat",
        "--dataset", "conversations",
        "--request-rate", "200",
        "--no-ignore-eos",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "A r=200/s" in capsys.readouterr().out
    assert all("ignore_eos" not in b for b in fake.bodies)
    assert all(b["messages"][-1]["role"] == "user" for b in fake.bodies)


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_transformers_serve_needs_no_ignore_eos(
    fake_server, tiny_tokenizer_dir, tmp_path, backend: str
) -> None:
    url, fake = fake_server
    fake.transformers_serve = True  # no `[DONE]`, and a 422 for `ignore_eos`
    argv = [
        *common_args(url, tiny_tokenizer_dir, tmp_path),
        "--backend", backend,
        "--concurrency", "2",
    ]  # fmt: skip
    assert main(argv) == 1  # every request refused
    assert main([*argv, "--no-ignore-eos"]) == 0
    record = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert (record["completed"], record["failed"]) == (4, 0)


def test_compare_alternates_and_prints_ratios(
    fake_server, tiny_tokenizer_dir, tmp_path, capsys
) -> None:
    url, fake = fake_server
    argv = [
        *common_args(url, tiny_tokenizer_dir, tmp_path),
        "--compare", url,
        "--compare-backend", "openai-completions",
        "--concurrency", "1,2",
        "--warmup", "0",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ratios A/B" in out
    # Default 2 rounds per level, A and B taking turns: A B A B per level.
    kinds = ["tgi" if "inputs" in b else "oai" for b in fake.bodies]
    assert kinds == (["tgi"] * 4 + ["oai"] * 4) * 4
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["target"], r["concurrency"], r["rounds"]) for r in records] == [
        ("A", 1, 2), ("B", 1, 2), ("A", 2, 2), ("B", 2, 2)
    ]  # fmt: skip
    assert all(r["completed"] == 8 for r in records)


def test_goodput_targets_come_from_the_command_line(
    fake_server, tiny_tokenizer_dir, tmp_path, capsys
) -> None:
    url, fake = fake_server
    fake.token_delay_s = 0.02  # every gap ~20 ms: good at 1000 ms, not at 5 ms
    for itl_ms, good in ((1000, 4), (5, 0)):
        argv = [
            *common_args(url, tiny_tokenizer_dir, tmp_path),
            "--concurrency", "1",
            "--goodput-ttft-ms", "5000",
            "--goodput-itl-ms", str(itl_ms),
        ]  # fmt: skip
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"good: TTFT <= 5000 ms and TPOT (mean ITL) <= {itl_ms} ms" in out
        assert "good %" in out and "goodput req/s" in out
        record = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
        assert record["good_requests"] == good
        assert record["good_fraction"] == good / 4
        assert record["goodput_targets"] == {"ttft_ms": 5000.0, "itl_ms": itl_ms}


def test_failures_are_reported_and_exit_nonzero(fake_server, tiny_tokenizer_dir, tmp_path, capsys):
    url, _ = fake_server
    # A wrong base path: every request fails with a 404.
    argv = [*common_args(url + "/nope", tiny_tokenizer_dir, tmp_path), "--concurrency", "2"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "4 failed; first error: HTTP 404" in out


def test_levels_from_args() -> None:
    parser = build_parser()
    assert levels_from_args(parser.parse_args(["--concurrency", "1,4,16"])) == (
        LoadLevel(concurrency=1), LoadLevel(concurrency=4), LoadLevel(concurrency=16)
    )  # fmt: skip
    args = parser.parse_args(["--request-rate", "0.5,2", "--max-concurrency", "8"])
    assert levels_from_args(args) == (
        LoadLevel(request_rate=0.5, max_concurrency=8), LoadLevel(request_rate=2.0, max_concurrency=8)
    )  # fmt: skip


def test_bad_levels_are_usage_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--concurrency", "0"])
    assert exc.value.code == 2
    assert "concurrency must be >= 1" in capsys.readouterr().err
