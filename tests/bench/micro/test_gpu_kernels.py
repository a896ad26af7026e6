"""bench/micro/gpu_kernels.py with the tiny shape on CPU: every row, the roofline arithmetic, the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from textgate.bench.micro import gpu_kernels as gk
from textgate.bench.micro import gpu_model


def test_the_8b_shape_is_llama_3_8b() -> None:
    shape = gpu_model.SHAPES["8b"]
    params = sum(torch.Size(s).numel() for s in shape.tensor_shapes().values())
    assert params == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert shape.kv_bytes_per_token(2) == 128 * 1024
    # Batch 1 at 1k context moves the weights (less the embedding table) and 128 MiB of KV.
    moved = gpu_model.decode_bytes(shape, 1, 1024, 2)
    assert moved == (shape.linear_params() + 4096) * 2 + 1025 * 128 * 1024
    assert 15.0e9 < moved < 15.2e9  # ~3.1 ms at an H200's 4.8 TB/s


def test_known_gpus_get_their_datasheet_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    for name, gbs in [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert gpu_model.bandwidth_for(cuda, None)[0] == gbs
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert gpu_model.bandwidth_for(cuda, None) == (None, "unknown (pass --bandwidth-gbs)")
    assert gpu_model.bandwidth_for(cuda, 1234.0) == (1234.0, "--bandwidth-gbs")


def test_tiny_shape_runs_every_row_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_md = tmp_path / "kernels.json", tmp_path / "kernels.md"
    gk.main(
        [
            "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,3", "--context", "40",
            "--prefill-tokens", "96", "--repeats", "2", "--bandwidth-gbs", "50",
            "--attention", "cpu,torch,nonexistent",
            "--json", str(out_json), "--markdown", str(out_md),
        ]
    )  # fmt: skip
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    decode = [r for r in rows if r["kind"] == "decode"]
    keys = {(r["backend"], r["graphs"], r["batch"]) for r in decode}
    assert keys == {
        (b, g, n) for b in ("torch", "cpu") for g in ("off", "on (eager stand-in)") for n in (1, 3)
    }
    assert rows[0]["backend"] == "torch"  # the reference runs first
    for row in decode:
        # The graph runner (padding, static buffers) and the C kernel agree with torch eager.
        assert row["max_diff"] is not None and row["max_diff"] < 1e-4, row
        assert row["ms"] > 0 and row["tokens_per_s"] == pytest.approx(
            row["batch"] / row["ms"] * 1e3
        )
        moved = gpu_model.decode_bytes(gpu_model.SHAPES["tiny"], row["batch"], 40, 4)
        assert row["roofline_ms"] == pytest.approx(moved / 50e9 * 1e3)
        assert row["roofline_ratio"] == pytest.approx(row["roofline_ms"] / row["ms"])
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert [(r["backend"], r["tokens"]) for r in prefill] == [("torch", 96), ("cpu", 96)]
    assert all(r["tflops"] > 0 for r in prefill)
    assert (
        "nonexistent" in report["skipped"]
        and "unknown attention backend" in report["skipped"]["nonexistent"]
    )
    table = out_md.read_text()
    assert table == capsys.readouterr().out
    assert table.count("\n| decode |") == 8 and "Not run: `nonexistent`" in table


def test_bad_arguments_are_refused() -> None:
    for argv in (
        ["--batch-sizes", "0"],
        ["--graphs", "maybe"],
        ["--shape", "tiny", "--context", "5000"],
    ):
        with pytest.raises(SystemExit):
            gk.parse_args(["--device", "cpu", *argv])
