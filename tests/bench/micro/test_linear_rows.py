"""The row-count bench runs both modes in their own processes and reports their ratio."""

from __future__ import annotations

import json

import pytest
import torch

from textgate.bench.micro import linear_rows
from textgate.kernels.linear import can_prepack


def test_shapes_parse_and_bad_ones_are_refused() -> None:
    assert linear_rows.parse_shapes("576x192, 8x4") == [(576, 192), (8, 4)]
    with pytest.raises(ValueError, match="IN x OUT"):
        linear_rows.parse_shapes("576by192")


@pytest.mark.skipif(not can_prepack(torch.zeros(2, 2)), reason="oneDNN packing unavailable")
def test_prints_both_passes_and_the_ratio(capsys) -> None:
    args = ["--dtype", "float32", "--shapes", "32x16", "--counts", "6", "--max-rows", "80"]
    assert linear_rows.main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "6 row counts in [33, 80]" in lines[0]
    passes = [line.split() for line in lines if line.startswith("pass")]
    assert [p[:2] for p in passes] == [["pass", "1"], ["pass", "2"]]
    for p in passes:  # (tiny shapes: the milliseconds print rounded, so no ratio check)
        assert all(float(value) >= 0 for value in p[2:5])


def test_one_mode_prints_its_two_passes_as_json(capsys) -> None:
    if not can_prepack(torch.zeros(2, 2)):
        pytest.skip("oneDNN packing unavailable")
    args = ["--dtype", "float32", "--shapes", "32x16", "--counts", "4", "--one", "padded"]
    assert linear_rows.main(args) == 0
    times = json.loads(capsys.readouterr().out)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_bad_row_ranges_are_refused() -> None:
    with pytest.raises(SystemExit, match="min-rows"):
        linear_rows.main(["--min-rows", "10", "--max-rows", "5"])
