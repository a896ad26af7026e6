"""The Triton fused-MoE kernel against its per-expert PyTorch reference and the MoE layer.

Runs on CUDA (`-m gpu`) or on CPU tensors in triton's interpreter (see conftest.py); a
subprocess also compiles the program for sm_90 without a GPU, as test_triton_compile does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgate.kernels.triton import fused_moe
from textgate.shard_server.layers.moe import Routing, SparseMoE, StackedExperts
from textgate.tests.kernels.triton_helpers import TOLERANCE, randn

HIDDEN, INTERMEDIATE = 40, 24  # neither a multiple of the 16/64 blocks


@pytest.fixture
def device(triton_device, monkeypatch):
    """The device, with the kernel enabled on it (CUDA only by default)."""
    monkeypatch.setattr(fused_moe, "enabled_devices", ("cuda", "cpu"))
    return triton_device


def experts(num_experts, dtype, device):
    """gate-up [E, 2 I, H] and down [E, H, I], scaled so that outputs stay near 1."""
    gate_up = randn(num_experts, 2 * INTERMEDIATE, HIDDEN, dtype=dtype, device=device, seed=1)
    down = randn(num_experts, HIDDEN, INTERMEDIATE, dtype=dtype, device=device, seed=2)
    return gate_up * HIDDEN**-0.5, down * INTERMEDIATE**-0.5


def route(num_tokens, num_experts, top_k, dtype, device, empty=None):
    """The layer's own routing of random logits; expert `empty` gets no token."""
    logits = randn(num_tokens, num_experts, dtype=torch.float32, device=device, seed=3)
    if empty is not None:
        logits[:, empty] = -1e9
    return Routing.top_k(logits, top_k, normalize=top_k > 1, dtype=dtype)


def run_both(num_tokens, num_experts, top_k, dtype, device, empty=None):
    """(kernel, reference) outputs [T, H] of one routed step."""
    hidden = randn(num_tokens, HIDDEN, dtype=dtype, device=device, seed=0)
    gate_up, down = experts(num_experts, dtype, device)
    routing = route(num_tokens, num_experts, top_k, dtype, device, empty)
    if empty is not None:
        assert routing.counts[empty] == 0
    args = (hidden, gate_up, down, routing.tokens, routing.weights, routing.counts)
    got = fused_moe.fused_moe(*args)
    assert got is not None
    return got, fused_moe.reference_fused_moe(*args)


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


# (tokens, experts, top_k, empty expert): one token, a few, and 33 (blocks of 16 and 32,
# partial last blocks); an expert without tokens before and after busy ones.
SHAPES = [
    (1, 4, 1, None),
    (1, 8, 2, None),
    (7, 4, 2, 2),
    (7, 8, 1, 0),
    (33, 8, 2, 5),
    (33, 4, 1, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "empty"), SHAPES)
def test_fused_moe_matches_the_per_expert_reference(
    device, dtype, num_tokens, num_experts, top_k, empty
):
    got, want = run_both(num_tokens, num_experts, top_k, dtype, device, empty)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == dtype
    assert_close(got, want, dtype)


def test_fused_moe_in_float16_with_blocks_of_64(device):
    got, want = run_both(70, 4, 2, torch.float16, device)  # 35 pairs an expert: BLOCK_M 64
    assert fused_moe.block_m_for(140, 4) == 64
    assert_close(got, want, torch.float16)


def test_block_map_cuts_each_experts_pairs_into_blocks():
    counts = torch.tensor([3, 0, 17, 16])  # 36 pairs: blocks of 16 → 1 + 0 + 2 + 1 = 4
    expert, first, end = fused_moe.block_map(counts, 36, 16)
    assert expert.tolist()[:4] == [0, 2, 2, 3] and set(expert.tolist()[4:]) == {-1}
    assert first.tolist()[:4] == [0, 3, 19, 20]
    assert end.tolist()[:4] == [3, 20, 20, 36]


def test_the_moe_layer_runs_the_kernel_where_enabled(device, monkeypatch):
    num_experts, dtype = 4, torch.float32
    gate_up, down = experts(num_experts, dtype, device)
    router = randn(num_experts, HIDDEN, dtype=dtype, device=device, seed=4)
    layer = SparseMoE(
        router, StackedExperts(gate_up, down), top_k=2, normalize_top_k=True, process_group=None
    )
    hidden = randn(9, HIDDEN, dtype=dtype, device=device, seed=5)
    routing = Routing.top_k(hidden @ router.T, 2, True, dtype)
    kernel = fused_moe.fused_moe(
        hidden, gate_up, down, routing.tokens, routing.weights, routing.counts
    )
    assert torch.equal(layer(hidden), kernel)
    monkeypatch.setattr(fused_moe, "enabled_devices", ())  # the layer's own path
    assert_close(layer(hidden), kernel, dtype)


def test_fused_moe_declines_what_it_does_not_handle(triton_device, monkeypatch):
    hidden = torch.randn(3, HIDDEN)
    gate_up, down = experts(4, torch.float32, "cpu")
    routing = route(3, 4, 2, torch.float32, "cpu")
    pairs = (routing.tokens, routing.weights, routing.counts)
    # Off the enabled devices (the CPU by default): the layer's grouped path runs.
    assert fused_moe.fused_moe(hidden, gate_up, down, *pairs) is None
    monkeypatch.setattr(fused_moe, "enabled_devices", ("cuda", "cpu"))
    hidden, gate_up, down = (t.to(triton_device) for t in (hidden, gate_up, down))
    pairs = tuple(t.to(triton_device) for t in pairs)
    assert fused_moe.fused_moe(hidden.double(), gate_up.double(), down.double(), *pairs) is None
    assert fused_moe.fused_moe(hidden, gate_up.bfloat16(), down, *pairs) is None  # mixed
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe.fused_moe(hidden, gate_up[:, 1:], down, *pairs)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from textgate.kernels.triton.fused_moe_kernels import expert_matmul_kernel as fn

for dtype, gate_up, upcast in [("bf16", True, False), ("bf16", False, False), ("fp32", True, True)]:
    types = {name: "*i64" for name in fn.arg_names if name.endswith("_ptr")}
    types.update({name: f"*{dtype}" for name in ("a_ptr", "w_ptr", "out_ptr", "route_weights_ptr")})
    constexprs = dict(GATE_UP=gate_up, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, UPCAST=upcast)
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    source = ASTSource(fn, signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("compiled", dtype, gate_up, flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="triton ships Linux wheels only")
def test_the_program_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile anew, whatever ran before
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("compiled") == 3
