"""cpu_dense.c through `dense_linear`: float32 and bfloat16 layers against the definition in
float64, the same bits at every instruction-set level in bfloat16, and each row's result
independent of the rows beside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from textgate.kernels import cpu_build, cpu_isa
from textgate.kernels import dense_linear as dense
from textgate.kernels.linear import FastLinear

pytestmark = pytest.mark.skipif(
    cpu_build.load_library() is None, reason="no C kernels here (no compiler)"
)

# (out, in): the embedded model's q/k/v and down projections, and shapes that leave a partial
# block of 16 outputs and fewer inputs than one vector.
SHAPES = [(960, 576), (576, 1536), (17, 6), (40, 64)]


def _random(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> float:
    """Largest error against float64, relative to |expected| + 1."""
    expected = x.double() @ weight.double().T
    if bias is not None:
        expected = expected + bias.double()
    return ((got.double() - expected).abs() / (expected.abs() + 1)).max().item()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 17, 33])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_computes_x_wt_plus_b(dtype, shape, rows, with_bias) -> None:
    out_features, in_features = shape
    weight = _random(out_features, in_features, dtype=dtype)
    bias = _random(out_features, dtype=dtype, seed=1) if with_bias else None
    packed = dense.pack_dense(weight, bias)
    assert packed is not None
    assert torch.equal(dense.unpack_dense(packed), weight)
    x = _random(rows, in_features, dtype=dtype, seed=2)
    got = dense.dense_linear(x, packed)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    # As close as torch's own F.linear (float32 sums in both; bfloat16 rounds the result).
    torch_error = _error(F.linear(x, weight, bias), x, weight, bias)
    assert _error(got, x, weight, bias) <= max(4 * torch_error, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype) -> None:
    weight = _random(200, 576, dtype=dtype)
    packed = dense.pack_dense(weight)
    x = _random(37, 576, dtype=dtype, seed=3)
    batched = dense.dense_linear(x, packed)
    for row in (0, 4, 17, 36):
        assert torch.equal(dense.dense_linear(x[row : row + 1], packed), batched[row : row + 1])


def test_it_reads_rows_with_a_stride_and_keeps_leading_dimensions() -> None:
    weight = _random(48, 32, dtype=torch.float32)
    packed = dense.pack_dense(weight)
    wide = _random(2, 3, 40, dtype=torch.float32, seed=4)
    x = wide[..., :32]  # rows 40 apart
    got = dense.dense_linear(x, packed)
    assert got.shape == (2, 3, 48)
    assert torch.equal(got, dense.dense_linear(x.contiguous(), packed))
    assert dense.dense_linear(torch.empty(0, 32), packed).shape == (0, 48)


def test_what_it_does_not_pack() -> None:
    assert dense.pack_dense(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert dense.pack_dense(torch.zeros(4, 5, dtype=torch.bfloat16)) is None  # odd inputs
    assert dense.pack_dense(torch.zeros(4, 4, requires_grad=True)) is None
    assert dense.pack_dense(torch.zeros(4)) is None


def test_where_fast_linear_uses_it(monkeypatch) -> None:
    def on_kernel(dtype: torch.dtype) -> bool:
        return FastLinear(torch.zeros(4, 4, dtype=dtype)).kernel_packed is not None

    library = cpu_build.load_library()
    vector = library.textgate_dense_isa() >= 1
    amx = "amx_bf16" in cpu_isa.cpu_features()
    assert on_kernel(torch.float32) == vector
    assert on_kernel(torch.bfloat16) == (vector and not amx)
    assert not on_kernel(torch.float16)
    monkeypatch.setenv(dense.DENSE_KERNEL_ENV, "0")  # oneDNN's packing (or the plain weight)
    assert not on_kernel(torch.float32) and not on_kernel(torch.bfloat16)
    monkeypatch.setenv(dense.DENSE_KERNEL_ENV, "1")  # the kernel wherever it builds
    assert on_kernel(torch.float32) and on_kernel(torch.bfloat16)
    # No AMX: bfloat16 on the kernel; AMX: left to oneDNN's tiles.
    monkeypatch.delenv(dense.DENSE_KERNEL_ENV)
    for features, expected in ((frozenset(), vector), (frozenset({"amx_bf16"}), False)):
        monkeypatch.setattr(cpu_isa, "cpu_features", lambda features=features: features)
        assert dense.serves(torch.bfloat16) == expected


def test_other_dtypes_of_input_take_the_reference() -> None:
    weight = _random(20, 8, dtype=torch.bfloat16)
    packed = dense.pack_dense(weight)
    x = _random(3, 8, dtype=torch.bfloat16, seed=5)
    with pytest.raises(RuntimeError):
        dense.dense_linear(x.float(), packed)  # F.linear refuses mixed dtypes, as before
    assert torch.equal(dense.reference_dense_linear(x, packed), F.linear(x, weight))


_BITS = """
import sys, torch
from textgate.kernels import cpu_build, dense_linear as dense
assert cpu_build.loaded_level() == {level!r}, cpu_build.loaded_level()
generator = torch.Generator().manual_seed(0)
weight = torch.randn(100, 576, generator=generator).bfloat16()
bias = torch.randn(100, generator=generator).bfloat16()
x = torch.randn(7, 576, generator=generator).bfloat16()
torch.save(dense.dense_linear(x, dense.pack_dense(weight, bias)), sys.argv[1])
"""


def test_every_level_gives_the_same_bfloat16_bits(tmp_path) -> None:
    """vdpbf16ps, the widening AVX512 and AVX2 paths and plain C add a bfloat16 pair's
    products in one order, each exact in float32: the same bits (the levels below this CPU's
    best are what other CI machines run)."""
    runs = [(level.name, {}) for level in cpu_isa.runnable_levels()]
    best = runs[-1][0]
    runs.append((best, {"TEXTGATE_DENSE_BF16_DOT": "0"}))
    outputs = []
    for index, (level, extra) in enumerate(runs):
        path = tmp_path / f"{index}.pt"
        env = {**os.environ, "TEXTGATE_CPU_ISA": level, **extra}
        result = subprocess.run(
            [sys.executable, "-c", _BITS.format(level=level), str(path)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(torch.load(path))
    for (level, extra), output in zip(runs, outputs, strict=True):
        assert torch.equal(output, outputs[0]), (level, extra)
