"""torch's int4 packing layouts: known ones round-trip, and the probe finds torch's own here."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels import int4_linear
from textgate.kernels.int4_linear import INT4_LAYOUTS, expand_int4, reference_expand_int4

#: What ATen's int4 packing kernel does on each CPU capability (torch 2.13).
EXPECTED = {"AVX512": "block64-halves", "AVX2": "block32-halves", "DEFAULT": "block32-pairs"}


def _codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", INT4_LAYOUTS, ids=lambda layout: layout.name)
def test_each_layout_round_trips_and_they_differ(layout):
    codes = _codes(128, 96)
    packed = layout.pack(codes)
    assert packed.shape == (128, 48) and packed.dtype == torch.uint8
    assert torch.equal(layout.unpack(packed), codes.int())
    others = [other.pack(codes) for other in INT4_LAYOUTS if other != layout]
    assert not any(torch.equal(packed, other) for other in others)


def test_the_probe_finds_torchs_layout_on_this_cpu():
    layout = int4_linear.torch_int4_layout()
    capability = torch.backends.cpu.get_cpu_capability()
    assert layout is not None, f"torch's int4 layout on {capability} is unknown"
    if capability in EXPECTED:
        assert layout.name == EXPECTED[capability]
    for n, k, seed in ((64, 32, 1), (192, 320, 2), (576, 1536, 3)):
        codes = _codes(n, k, seed)
        torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        assert torch.equal(layout.pack(codes), torch_packed)


def test_an_unknown_layout_turns_the_expansion_off(monkeypatch):
    packed = INT4_LAYOUTS[0].pack(_codes(64, 64))
    scales_and_zeros = torch.randn(1, 64, 2).bfloat16()
    monkeypatch.setattr(int4_linear, "torch_int4_layout", lambda: None)
    assert expand_int4(packed, scales_and_zeros, 64) is None
    with pytest.raises(ValueError, match="unknown"):
        reference_expand_int4(packed, scales_and_zeros, 64)


@pytest.mark.parametrize("layout", INT4_LAYOUTS, ids=lambda layout: layout.name)
def test_the_c_expansion_reads_every_layout(layout, monkeypatch):
    monkeypatch.setattr(int4_linear, "torch_int4_layout", lambda: layout)
    codes = _codes(192, 128, 4)
    scales_and_zeros = torch.randn(2, 192, 2).bfloat16()  # groups of 64
    dense = expand_int4(layout.pack(codes), scales_and_zeros, 64)
    if dense is None:
        pytest.skip("no C compiler")
    groups = scales_and_zeros.float().repeat_interleave(64, dim=0)  # [in, out, 2]
    want = (codes.t() - 8).float() * groups[..., 0] + groups[..., 1]
    torch.testing.assert_close(dense.float(), want.bfloat16().float(), rtol=2**-8, atol=0)
