"""`python -m textgate.bench.micro.bnb_linear` prints one row per shape and row count."""

from __future__ import annotations

import pytest

from textgate.bench.micro import bnb_linear

pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_one_row_per_shape_with_both_modes(method, capsys):
    bnb_linear.main(["--method", method, "--rows", "1", "--rounds", "1", "--dtype", "float32"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("time / dense FastLinear time")
    rows = [line.split() for line in lines[3:]]
    assert [row[0] for row in rows] == [f"{i}x{o}" for i, o in bnb_linear.SHAPES]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)  # train, eval ratios
