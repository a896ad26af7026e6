"""bench/micro/moe.py on a tiny shape: the four candidates agree, every row is timed."""

from __future__ import annotations

import pytest
import torch

from textgate.bench.micro import moe


def test_prints_each_candidate_per_step_size(capsys) -> None:
    argv = ["--hidden", "64", "--intermediate", "32", "--experts", "4", "--top-k", "2"]
    assert moe.main([*argv, "--tokens", "1,6", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 experts of 32, top 2, float32" in out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [row[0] for row in rows] == ["1", "6"]
    assert all(float(value.removesuffix("x")) > 0 for row in rows for value in row[1:])


def test_a_wrong_candidate_is_caught() -> None:
    layer = moe.Layer.random(moe.MoEShape(64, 32, 4, 2), torch.float32)
    fns = moe.candidates(layer)
    fns["grouped"] = lambda hidden: torch.zeros_like(hidden)
    with pytest.raises(AssertionError, match="grouped differs"):
        moe.check_agreement(fns, torch.randn(3, 64))
