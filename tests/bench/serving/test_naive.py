from __future__ import annotations

import itertools
import json

import pytest

from textgate.bench.serving import naive
from textgate.bench.serving.tokenizer import load_tokenizer
from textgate.bench.serving.workload import WorkloadSpec, build_requests


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return naive.load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_generate_timed_forces_the_output_length(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    request = build_requests(WorkloadSpec(input_len=8), tokenizer, 1)[0]
    out = naive.generate_timed(model, tokenizer, request, output_len=6)
    assert out.success
    assert out.output_tokens == 6
    assert len(out.itl) == 5
    assert out.prompt_len == 8
    assert 0 < out.ttft <= out.latency


def test_run_naive_runs_requests_one_at_a_time(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    requests = build_requests(WorkloadSpec(input_len=8), tokenizer, 3)
    outcomes, duration = naive.run_naive(model, tokenizer, requests, 4, warmup=1, log=print)
    assert [o.output_tokens for o in outcomes] == [4, 4, 4]
    # Sequential: each request starts after the previous one's last token.
    for before, after in itertools.pairwise(outcomes):
        assert after.start_time >= before.start_time + before.latency
    assert duration >= sum(o.latency for o in outcomes)


def test_token_timer_skips_the_prompt() -> None:
    timer = naive.TokenTimer()
    timer.put("prompt ids")
    timer.put("token")
    timer.put("token")
    timer.end()
    assert len(timer.times) == 2


def test_main_prints_the_tables(tiny_model_dir, tmp_path, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--num-requests", "2", "--output-len", "3",
            "--input-len", "6", "--json-out", str(tmp_path / "naive.jsonl")]  # fmt: skip
    assert naive.main(argv) == 0
    out = capsys.readouterr().out
    assert "naive" in out and "TPOT" in out
    record = json.loads((tmp_path / "naive.jsonl").read_text())
    assert (record["target"], record["completed"], record["total_output_tokens"]) == ("naive", 2, 6)
