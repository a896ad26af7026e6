"""The Triton segmented LoRA kernels against their per-segment PyTorch reference and the
LoRA layer's own per-adapter loop.

Runs on CUDA (`-m gpu`) or on CPU tensors in triton's interpreter (see conftest.py); a
subprocess also compiles the programs for sm_90 without a GPU, as test_triton_compile does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgate.kernels.triton import lora_sgmv
from textgate.kernels.triton.lora_sgmv import Segments
from textgate.shard_server.layers import lora
from textgate.shard_server.layers.lora import LoraLayer, LoraRows, lora_rows
from textgate.tests.kernels.triton_helpers import TOLERANCE, randn

INPUTS, OUTPUTS = 40, 72  # neither a multiple of the 64 blocks; two column blocks
NUM_ROWS = 37  # not a multiple of the 16-row block


@pytest.fixture
def device(triton_device, monkeypatch):
    """The device, with the kernels enabled on it (CUDA only by default)."""
    monkeypatch.setattr(lora_sgmv, "enabled_devices", ("cuda", "cpu"))
    return triton_device


def pairs(ranks, dtype, device, outputs=OUTPUTS):
    """One (A [r, in], B [out, r]) per rank, scaled so that updates stay near 1."""
    return [
        (
            randn(rank, INPUTS, dtype=dtype, device=device, seed=10 + i, scale=INPUTS**-0.5),
            randn(outputs, rank, dtype=dtype, device=device, seed=20 + i, scale=rank**-0.5),
        )
        for i, rank in enumerate(ranks)
    ]


def stack(weights, outputs=OUTPUTS):
    """The pairs zero-padded to the largest rank: A [S, r, in], B [S, out, r]."""
    rank = max(a.shape[0] for a, _ in weights)
    a_all = weights[0][0].new_zeros(len(weights), rank, INPUTS)
    b_all = weights[0][0].new_zeros(len(weights), outputs, rank)
    for i, (a, b) in enumerate(weights):
        a_all[i, : a.shape[0]], b_all[i, :, : a.shape[0]] = a, b
    return a_all, b_all


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def uneven_segments(device):
    """35 of 37 rows shuffled, cut into runs of 5, 15, 0, 9 (no adapter), 4 and 2 rows
    over adapters 2, 0, 1, -, 1, 2; rows 0 and 1 are in no run."""
    rows = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(7))
    rows = rows[rows > 1]
    starts = torch.tensor([0, 5, 20, 20, 29, 33])
    ends = torch.tensor([5, 20, 20, 29, 33, 35])
    slots = torch.tensor([2, 0, 1, -1, 1, 2])
    untouched = [0, 1, *rows[20:29].tolist()]
    return Segments(*(t.to(device) for t in (rows, starts, ends, slots))), untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [(4, 4, 4), (8, 8, 8), (16, 8, 4)])
def test_sgmv_add_matches_the_per_segment_reference(device, dtype, ranks):
    segments, untouched = uneven_segments(device)
    a, b = stack(pairs(ranks, dtype, device))
    x = randn(NUM_ROWS, INPUTS, dtype=dtype, device=device, seed=0)
    y = randn(NUM_ROWS, OUTPUTS, dtype=dtype, device=device, seed=1)
    got = lora_sgmv.sgmv_add(x, y.clone(), a, b, segments, scale=0.5)
    assert got is not None and got.dtype == dtype
    assert_close(got, lora_sgmv.reference_sgmv_add(x, y.clone(), a, b, segments, 0.5), dtype)
    assert torch.equal(got[untouched], y[untouched])  # no run, or a run without adapter
    assert not torch.allclose(got.float(), y.float(), atol=0.1)


def layer_step(ranks, slots, dtype, device):
    """A LoraLayer with adapters of `ranks` in slots 1, 2, ... (slot 2 none when ranks
    has a None there), and one step's inputs, base outputs and rows of `slots`."""
    layer = LoraLayer(OUTPUTS)
    weights = pairs([rank or 4 for rank in ranks], dtype, device)
    for slot, (rank, (a, b)) in enumerate(zip(ranks, weights, strict=True), start=1):
        if rank is not None:
            layer.updates[slot] = [(0, OUTPUTS, a, b, 0.5)]
    layer.fuse()
    x = randn(len(slots), INPUTS, dtype=dtype, device=device, seed=0)
    base = randn(len(slots), OUTPUTS, dtype=dtype, device=device, seed=1)
    rows = LoraRows.from_slots(slots, torch.device(device))
    assert rows is not None
    folded = [
        (a, b * 0.5) if r else (a * 0, b * 0) for r, (a, b) in zip(ranks, weights, strict=True)
    ]
    return layer, x, base, rows, stack(folded)


# Row i's slot: uneven runs once sorted (slot 1: 18 rows, slot 2: 3, slot 3: none, slot 4:
# 9 rows the layer has no adapter for), base rows among them; 37 rows.
SLOTS = [1, 0, 2, 1, 4] * 3 + [1] * 10 + [0, 4, 4, 4, 4, 4, 1, 4, 0, 0, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_sgmv_add_matches_the_lora_layers_loop(device, dtype, monkeypatch):
    assert len(SLOTS) == NUM_ROWS
    layer, x, base, rows, (a, b) = layer_step((8, 4, 16), SLOTS, dtype, device)
    monkeypatch.setattr(lora, "GROUPED_MM", None)  # the layer's per-adapter loop
    monkeypatch.setattr(lora, "DENSE_MAX_ROWS", 0)
    with lora_rows(rows):
        want = layer.add(x, base.clone())
    got = lora_sgmv.lora_sgmv_add(x, base.clone(), rows.order, rows.ends, a, b)
    assert got is not None
    assert_close(got, want, dtype)
    untouched = [row for row, slot in enumerate(SLOTS) if slot in (0, 4)]
    assert torch.equal(got[untouched], base[untouched])


def test_lora_sgmv_add_with_a_slot_the_layer_lacks_in_float16(device, monkeypatch):
    monkeypatch.setattr(lora, "DENSE_MAX_ROWS", 0)  # the layer's sparse paths
    slots = [3, 1, 0, 3, 1, 3, 2, 2, 0]  # slot 2 has rows but no update in this layer
    layer, x, base, rows, (a, b) = layer_step((16, None, 8), slots, torch.float16, device)
    got = lora_sgmv.lora_sgmv_add(x, base.clone(), rows.order, rows.ends, a, b)
    assert got is not None
    with lora_rows(rows):
        assert_close(got, layer.add(x, base.clone()), torch.float16)
    assert torch.equal(got[[2, 6, 7, 8]], base[[2, 6, 7, 8]])


def test_ranks_past_one_rank_block(device):
    segments, _ = uneven_segments(device)
    a, b = stack(pairs((80, 8, 72), torch.float32, device))  # two rank blocks of 64
    x = randn(NUM_ROWS, INPUTS, dtype=torch.float32, device=device, seed=0)
    y = randn(NUM_ROWS, OUTPUTS, dtype=torch.float32, device=device, seed=1)
    got = lora_sgmv.sgmv_add(x, y.clone(), a, b, segments)
    assert got is not None
    assert_close(got, lora_sgmv.reference_sgmv_add(x, y.clone(), a, b, segments), torch.float32)


def test_blocks_cut_each_run_and_skip_runs_without_adapter():
    rows = torch.arange(40)
    starts, ends = torch.tensor([0, 3, 3, 20, 36]), torch.tensor([3, 3, 20, 36, 40])
    slots = torch.tensor([0, 1, 2, -1, 0])  # 3 + 0 + 17 + (16 skipped) + 4 rows
    blocks = Segments(rows, starts, ends, slots).blocks(block_m=16)
    assert blocks.slot.tolist() == [0, 2, 2, 0, -1, -1, -1]  # 7: the most 40 rows can need
    assert blocks.first.tolist()[:4] == [0, 3, 19, 36]
    assert blocks.end.tolist()[:4] == [3, 20, 20, 40]


def test_segments_from_lora_rows():
    rows = LoraRows.from_slots([2, 0, 1, 3, 2, 1], torch.device("cpu"))
    assert rows is not None
    segments = Segments.from_ends(rows.order, rows.ends, num_adapters=2)
    assert segments.rows.tolist() == [2, 5, 0, 4, 3]
    assert segments.starts.tolist() == [0, 2, 4] and segments.ends.tolist() == [2, 4, 5]
    assert segments.slots.tolist() == [0, 1, -1]  # the layer has no third adapter


def test_the_kernels_decline_what_they_do_not_handle(triton_device, monkeypatch):
    segments, _ = uneven_segments("cpu")
    a, b = stack(pairs((4, 8, 4), torch.float32, "cpu"))
    x, y = torch.randn(NUM_ROWS, INPUTS), torch.randn(NUM_ROWS, OUTPUTS)
    # Off the enabled devices (the CPU by default): the layer's own path runs.
    assert lora_sgmv.sgmv_add(x, y, a, b, segments) is None
    assert lora_sgmv.lora_sgmv_add(x, y, segments.rows, segments.ends, a, b) is None
    assert not lora_sgmv.supports(x)
    monkeypatch.setattr(lora_sgmv, "enabled_devices", ("cuda", "cpu"))
    x, y, a, b = (t.to(triton_device) for t in (x, y, a, b))
    assert lora_sgmv.supports(x) and not lora_sgmv.supports(x.double())
    elsewhere = segments.rows.to("meta")  # rows on another device than the activations
    assert lora_sgmv.lora_sgmv_add(x, y, elsewhere, segments.ends, a, b) is None
    segments = Segments(*(t.to(triton_device) for t in vars(segments).values()))
    assert lora_sgmv.sgmv_add(x.double(), y.double(), a.double(), b.double(), segments) is None
    assert lora_sgmv.sgmv_add(x, y, a.bfloat16(), b, segments) is None  # mixed
    with pytest.raises(ValueError, match="do not fit"):
        lora_sgmv.sgmv_add(x, y, a[:, :, 1:].contiguous(), b, segments)
    with pytest.raises(ValueError, match="do not fit"):
        lora_sgmv.sgmv_add(x, y, a, b[:, :, 1:].contiguous(), segments)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from textgate.kernels.triton import lora_sgmv_kernels as lk

def compile_(fn, dtype, floats, constexprs):
    types = {name: "*i64" for name in fn.arg_names if name.endswith("_ptr")}
    types.update({name: f"*{dtype}" for name in floats}, scale="fp32")
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    source = ASTSource(fn, signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("compiled", fn.__name__, dtype, flush=True)

for dtype, upcast, block_m in [("bf16", False, 16), ("fp16", False, 64), ("fp32", True, 32)]:
    compile_(lk.sgmv_shrink_kernel, dtype, ("x_ptr", "a_ptr", "v_ptr"),
             dict(BLOCK_M=block_m, BLOCK_R=16, BLOCK_K=64, UPCAST=upcast))
    compile_(lk.sgmv_expand_kernel, dtype, ("v_ptr", "b_ptr", "y_ptr"),
             dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=64, UPCAST=upcast))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="triton ships Linux wheels only")
def test_the_programs_compile_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile anew, whatever ran before
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("compiled") == 6
