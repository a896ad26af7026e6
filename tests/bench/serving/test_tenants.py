"""`python -m textgate.bench.serving.tenants`: the key file it serves, and a short run of
both tenants against the fake server."""

from __future__ import annotations

import json
import math

import pytest

from textgate.bench.serving import tenants
from textgate.bench.serving.metrics import RequestOutcome


def test_the_generated_key_file_names_two_tenants_with_their_weights(tmp_path) -> None:
    keys = json.loads(tenants.key_file(tmp_path, 1.0, 3.0).read_text())["keys"]
    assert [(k["key"], k["tenant"], k["weight"]) for k in keys] == [
        (tenants.HEAVY_KEY, "heavy", 1.0), (tenants.LIGHT_KEY, "light", 3.0)
    ]  # fmt: skip


def test_ttft_percentiles_skip_failures() -> None:
    outcomes = [RequestOutcome(True, ttft=t) for t in (0.1, 0.2, 0.3)]
    outcomes.append(RequestOutcome(False, ttft=9.0))
    assert tenants.ttft_ms(outcomes, 50) == pytest.approx(200.0)
    assert math.isnan(tenants.ttft_ms([RequestOutcome(False)], 50))


def test_a_short_run_sends_each_tenant_with_its_key(
    fake_server, tiny_tokenizer_dir, tmp_path, capsys
) -> None:
    url, fake = fake_server
    fake.token_delay_s = 0.005
    out_file = tmp_path / "tenants.jsonl"
    argv = [
        "--url", url, "--heavy-key", "sk-h", "--light-key", "sk-l",
        "--tokenizer", str(tiny_tokenizer_dir),
        "--heavy-concurrency", "3", "--light-concurrency", "1", "--light-requests", "2",
        "--output-len", "8", "--rounds", "2", "--json-out", str(out_file),
    ]  # fmt: skip
    assert tenants.main(argv) == 0
    out = capsys.readouterr().out
    assert "together/alone p50" in out and "median together/alone p50" in out
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["failed"] == 0 and r["light_alone_ttft_p50_ms"] > 0
        assert r["ratio"] == pytest.approx(
            r["light_together_ttft_p50_ms"] / r["light_alone_ttft_p50_ms"]
        )
        assert r["heavy_tok_s"] > 0 and r["light_tok_s"] > 0
    # Light requests: 2 alone + 2 together per round; the heavy tenant's fill the rest.
    assert fake.authorizations.count("Bearer sk-l") == 8
    assert fake.authorizations.count("Bearer sk-h") >= 3 * 2
    assert set(fake.authorizations) == {"Bearer sk-l", "Bearer sk-h"}


def test_a_url_needs_both_keys() -> None:
    with pytest.raises(SystemExit):
        tenants.main(["--url", "http://127.0.0.1:1", "--heavy-key", "k"])
