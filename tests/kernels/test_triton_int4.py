"""The Triton int4 dequant-matmul against the PyTorch dequantize-then-matmul reference.

Runs on CUDA (`-m gpu`) or on CPU tensors in triton's interpreter (see conftest.py).
Random codes, GPTQ's layout (act-order g_idx, sym and asym zeros) and AWQ's GEMM layout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgate.kernels import int4_linear
from textgate.kernels.int4_linear import TritonInt4Linear, build_quantized_linear
from textgate.kernels.linear import FastLinear
from textgate.kernels.packing import (
    GPTQ_V2,
    UnpackedWeight,
    contiguous_g_idx,
    dequantize,
    pack_awq,
    pack_gptq,
    unpack_awq,
)
from textgate.shard_server.models import load_model
from textgate.tests.prefill import prefill_logits
from textgate.tests.quantization.test_gptq_model import write_pair

# The weight is the same in both (dequantized in float32, rounded to the dtype); the sums
# differ in order and the interpreter truncates float32 -> bfloat16 where a GPU rounds.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
IN_FEATURES, OUT_FEATURES = 256, 80  # 80: a partial column block of 64


@pytest.fixture
def device(triton_device, monkeypatch):
    """The device, with the Triton layer enabled on it (CUDA only by default)."""
    monkeypatch.setattr(int4_linear, "TRITON_DEVICES", ("cuda", "cpu"))
    return triton_device


def random_weight(
    group_size: int, act_order: bool, sym: bool, bits: int = 4, seed: int = 0
) -> UnpackedWeight:
    """Random codes, scales and zeros of an [OUT, IN] layer (CPU tensors)."""
    gen = torch.Generator().manual_seed(seed)
    g_idx = contiguous_g_idx(IN_FEATURES, group_size)
    if act_order:  # desc_act: the groups scattered over the inputs
        g_idx = g_idx[torch.randperm(IN_FEATURES, generator=gen)]
    groups = int(g_idx.max()) + 1
    levels = 1 << bits
    intweight = torch.randint(0, levels, (OUT_FEATURES, IN_FEATURES), generator=gen)
    if sym:
        zeros = torch.full((groups, OUT_FEATURES), levels // 2)
    else:
        zeros = torch.randint(0, levels, (groups, OUT_FEATURES), generator=gen)
    scales = (torch.rand(groups, OUT_FEATURES, generator=gen) * 0.02 + 0.001).half()
    return UnpackedWeight(intweight.int(), scales, zeros.int(), g_idx)


def activations(rows: int, dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN_FEATURES, generator=gen).to(dtype).to(device)


def assert_close(actual, expected, dtype):
    actual, expected = actual.float().cpu(), expected.float().cpu()
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= TOLERANCE[dtype] * scale


def expected_output(x: torch.Tensor, unpacked: UnpackedWeight) -> torch.Tensor:
    """The reference layer: the weight dequantized to x's dtype, the matmul in float32."""
    weight = dequantize(unpacked, x.dtype)  # [out, in]
    return x.cpu().float() @ weight.float().T


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("group_size", "act_order", "sym"), [(32, False, True), (64, True, False), (128, False, False)]
)
def test_kernel_matches_the_reference_on_ragged_rows(device, dtype, group_size, act_order, sym):
    from textgate.kernels.triton.int4_matmul import int4_matmul, reference_int4_matmul

    unpacked = random_weight(group_size, act_order, sym)
    packed = pack_gptq(*unpacked, bits=4, checkpoint_format=GPTQ_V2)
    on_device = {name: t.to(device) for name, t in packed.items()}
    for rows in (1, 7, 40):  # a decode step, a partial row block, two row blocks of 32
        x = activations(rows, dtype, device, seed=rows)
        out = int4_matmul(x, **on_device, bits=4)
        assert out.shape == (rows, OUT_FEATURES) and out.dtype == dtype
        assert_close(out, expected_output(x, unpacked), dtype)
        # the reference restated beside the kernel agrees
        assert_close(reference_int4_matmul(x, **on_device, bits=4), out, dtype)


@pytest.mark.parametrize("bits", [2, 8])
def test_kernel_takes_other_gptq_widths(device, bits):
    from textgate.kernels.triton.int4_matmul import int4_matmul

    unpacked = random_weight(64, True, False, bits=bits)
    packed = pack_gptq(*unpacked, bits=bits, checkpoint_format=GPTQ_V2)
    x = activations(3, torch.float16, device)
    out = int4_matmul(x, **{n: t.to(device) for n, t in packed.items()}, bits=bits)
    assert_close(out, expected_output(x, unpacked), torch.float16)


def test_leading_dims_and_strided_rows(device):
    from textgate.kernels.triton.int4_matmul import int4_matmul

    unpacked = random_weight(32, False, False)
    packed = pack_gptq(*unpacked, bits=4, checkpoint_format=GPTQ_V2)
    packed = {n: t.to(device) for n, t in packed.items()}
    wide = activations(6, torch.bfloat16, device).repeat(1, 2)  # rows strided by 2 * IN
    x = wide[:, :IN_FEATURES].reshape(2, 3, IN_FEATURES)
    out = int4_matmul(x, **packed)
    assert out.shape == (2, 3, OUT_FEATURES)
    assert_close(out.reshape(6, -1), expected_output(x.reshape(6, -1), unpacked), torch.bfloat16)
    assert int4_matmul(x[:0, 0], **packed).shape == (0, OUT_FEATURES)


@pytest.mark.parametrize("method", ["gptq-act-order", "awq"])
def test_layer_serves_gptq_and_repacked_awq(device, method):
    if method == "awq":  # AWQ's GEMM layout, read back as the loader reads it
        codes = random_weight(64, False, False)
        unpacked = unpack_awq(**pack_awq(codes.intweight, codes.scales, codes.zeros))
    else:
        unpacked = random_weight(128, True, True)
    unpacked = UnpackedWeight(*(t.to(device) for t in unpacked))
    bias = torch.randn(OUT_FEATURES).to(torch.bfloat16).to(device)
    layer = build_quantized_linear(unpacked, 4, torch.bfloat16, bias)
    assert isinstance(layer, TritonInt4Linear)
    assert layer.qweight.numel() * 8 == IN_FEATURES * OUT_FEATURES  # 4 bits a weight
    x = activations(5, torch.bfloat16, device)
    expected = expected_output(x, UnpackedWeight(*(t.cpu() for t in unpacked)))
    assert_close(layer(x), expected + bias.float().cpu(), torch.bfloat16)


def test_cpu_float32_and_bad_input_keep_or_refuse(device, monkeypatch):
    from textgate.kernels.triton.int4_matmul import int4_matmul

    unpacked = UnpackedWeight(*(t.to(device) for t in random_weight(64, False, True)))
    # float32 models keep the dequantized reference; off TRITON_DEVICES the CPU layers serve.
    assert isinstance(build_quantized_linear(unpacked, 4, torch.float32), FastLinear)
    monkeypatch.setattr(int4_linear, "TRITON_DEVICES", ("cuda",))
    if device == "cpu":
        assert not isinstance(build_quantized_linear(unpacked, 4, torch.bfloat16), TritonInt4Linear)
    packed = pack_gptq(*(t.cpu() for t in unpacked), bits=4, checkpoint_format=GPTQ_V2)
    packed = {n: t.to(device) for n, t in packed.items()}
    x = activations(2, torch.float16, device)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        int4_matmul(x.float(), **packed)
    with pytest.raises(ValueError, match="features"):
        int4_matmul(x[:, :128], **packed)
    with pytest.raises(ValueError, match="g_idx must be int32"):
        int4_matmul(x, **(packed | {"g_idx": packed["g_idx"].long()}))
    with pytest.raises(ValueError, match="needs scales"):
        int4_matmul(x, **(packed | {"scales": packed["scales"][:, :72]}))


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_model_runs_on_the_triton_layers(device, tmp_path, desc_act):
    """The tiny GPTQ Llama loaded on the device: its quantized linears are the Triton layer,
    and the logits are its dequantized twin's."""
    float_dir, gptq_dir = write_pair(tmp_path, desc_act)
    tokens = torch.randint(0, 101, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    model = load_model(gptq_dir, torch.bfloat16, device)
    triton_layers = [m for m in model.modules() if isinstance(m, TritonInt4Linear)]
    # Per layer qkv, o, gate_up, down; write_pair's act-order gives q/k/v (gate/up) orders
    # of their own, which no one int layout fuses: those stay floating point.
    assert len(triton_layers) == 2 * (2 if desc_act else 4)
    got = prefill_logits(model, tokens, device)
    want = prefill_logits(load_model(float_dir, torch.bfloat16, "cpu"), tokens, "cpu")
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


@pytest.mark.skipif(sys.platform != "linux", reason="triton ships Linux wheels only")
def test_program_compiles_for_sm90(tmp_path: Path) -> None:
    """The interpreter accepts what the compiler may reject: compile for H100/H200 too."""
    script = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from textgate.kernels.triton.int4_matmul import int4_matmul_kernel as fn

types = {"x_ptr": "*bf16", "out_ptr": "*bf16", "scales_ptr": "*fp16", "qweight_ptr": "*i32",
         "qzeros_ptr": "*i32", "g_idx_ptr": "*i32"}
for bits, block_m in ((4, 16), (4, 64), (8, 32)):
    constexprs = dict(BITS=bits, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, UPCAST=False)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("compiled", bits, block_m, flush=True)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("compiled") == 3
