from __future__ import annotations

import json

import pytest
import torch

from textgate.bench.serving import roofline


def test_linear_shapes_read_from_safetensors_headers(tiny_model_dir) -> None:
    shapes = roofline.linear_shapes(tiny_model_dir)
    names = [s.name for s in shapes]
    # 2 layers × (q, k, v, o, gate, up, down), plus the tied lm_head; no embedding, no norms.
    assert len(shapes) == 2 * 7 + 1
    assert not any(n.split(".", 1)[-1] == "embed_tokens.weight" for n in names)
    assert not any("norm" in n for n in names)
    lm_head = next(s for s in shapes if "lm_head" in s.name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert (lm_head.out_features, lm_head.in_features) == (config["vocab_size"], 32)
    q = next(s for s in shapes if s.name.endswith("layers.0.self_attn.q_proj.weight"))
    assert (q.out_features, q.in_features) == (32, 32)


def test_untied_lm_head_is_taken_as_is(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(10, 4),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
            "lm_head.weight": torch.zeros(10, 4),
            "model.norm.weight": torch.zeros(4),
        },
        str(tmp_path / "model.safetensors"),
    )
    shapes = roofline.linear_shapes(tmp_path)
    assert sorted((s.name, s.out_features, s.in_features) for s in shapes) == [
        ("lm_head.weight", 10, 4),
        ("model.layers.0.mlp.up_proj.weight", 8, 4),
    ]


def test_measure_reports_consistent_rows(tiny_model_dir) -> None:
    shapes = roofline.linear_shapes(tiny_model_dir)
    rows = roofline.measure(shapes, batches=(1, 4), dtypes=("float32", "bfloat16"), repeats=1)
    assert [(r.dtype, r.batch) for r in rows] == [
        ("float32", 1), ("float32", 4), ("bfloat16", 1), ("bfloat16", 4)
    ]  # fmt: skip
    params = sum(s.out_features * s.in_features for s in shapes)
    for r in rows:
        assert r.tok_per_s == r.batch * 1e3 / r.ms_per_step
        assert r.weight_gb == params * (4 if r.dtype == "float32" else 2) / 1e9


def test_main(tiny_model_dir, tmp_path, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "1,2", "--dtype", "float32",
            "--repeats", "1", "--json-out", str(tmp_path / "roof.jsonl")]  # fmt: skip
    assert roofline.main(argv) == 0
    assert "ms/step" in capsys.readouterr().out
    lines = (tmp_path / "roof.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["batch"] for r in records if r.get("row") != "floor"] == [1, 2]


def test_read_bandwidth_is_bytes_over_the_fastest_repeat() -> None:
    # Each repeat reads the clock twice; the second of three sums is the fastest (0.25 s).
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])
    bandwidth = roofline.read_bandwidth(1 << 20, repeats=3, timer=lambda: next(ticks))
    assert bandwidth == (1 << 20) / 0.25


def test_read_bandwidth_measures_something_positive() -> None:
    assert roofline.read_bandwidth(1 << 20, repeats=2) > 0


def test_step_bytes_per_weight_format() -> None:
    shapes = [roofline.LinearShape("q", 8, 256), roofline.LinearShape("lm_head", 10, 256)]
    formats = roofline.FORMATS
    assert formats["float32"].step_bytes(shapes) == 18 * 256 * 4
    assert formats["bfloat16"].step_bytes(shapes) == 18 * 256 * 2
    # int8: one byte per weight, 8 bytes of scale and column sum per output row.
    assert formats["int8"].step_bytes(shapes) == 18 * 256 + 18 * 8
    # int4: half a byte, 4 bytes per 128 inputs of a row; the head stays bf16.
    assert formats["int4-g128"].step_bytes(shapes) == 8 * 256 // 2 + 8 * 2 * 4 + 10 * 256 * 2


def test_floor_is_step_bytes_over_bandwidth_beside_the_measured_pass() -> None:
    measured = [
        roofline.RooflineRow("float32", 1, 45.0, 22.2, 0.54, 12.0, 6.0),
        roofline.RooflineRow("float32", 32, 130.0, 246.0, 0.54, 4.0, 60.0),
    ]
    rows = roofline.floor_rows({"float32": 540_000_000, "int8": 135_000_000}, 13.5e9, measured)
    f32, int8 = rows
    assert (f32.floor_ms, f32.measured_ms, f32.step_mb) == (pytest.approx(40.0), 45.0, 540.0)
    assert f32.floor_tok_per_s == pytest.approx(25.0)
    assert (int8.floor_ms, int8.measured_ms) == (pytest.approx(10.0), None)
    table = roofline.format_floor(rows)
    assert "floor ms" in table and table.splitlines()[-1].split()[-1] == "-"


def test_main_prints_the_floor_for_the_formats_and_the_server_bytes(
    tiny_model_dir, tmp_path, capsys
) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "1", "--dtype", "float32",
            "--repeats", "1", "--formats", "float32,int8", "--weight-bytes", "1000000",
            "--bandwidth-mib", "1", "--json-out", str(tmp_path / "roof.jsonl")]  # fmt: skip
    assert roofline.main(argv) == 0
    out = capsys.readouterr().out
    assert "bandwidth floor" in out and "--weight-bytes" in out
    records = [json.loads(line) for line in (tmp_path / "roof.jsonl").read_text().splitlines()]
    floors = [r for r in records if r.get("row") == "floor"]
    assert [r["format"] for r in floors] == ["float32", "int8", "--weight-bytes"]
    assert floors[0]["measured_ms"] == records[0]["ms_per_step"]
    assert floors[2]["step_mb"] == 1.0


def test_unknown_formats_are_refused(tiny_model_dir) -> None:
    with pytest.raises(SystemExit, match="unknown weight formats"):
        roofline.main(["--model", str(tiny_model_dir), "--batch", "1", "--dtype", "float32",
                       "--repeats", "1", "--formats", "int3"])  # fmt: skip
