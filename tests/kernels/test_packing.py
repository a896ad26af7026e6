"""GPTQ and AWQ on-disk layouts: hand-checked words, round trips, dequantization."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.packing import (
    GPTQ_V1,
    GPTQ_V2,
    contiguous_g_idx,
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq,
    unpack_awq,
    unpack_gptq,
)


def _random_layer(out_f: int, in_f: int, groups: int, bits: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    intweight = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (groups, out_f), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, out_f, generator=gen) * 0.02 + 0.001).half()
    return intweight, scales, zeros


def test_gptq_words_by_hand() -> None:
    # in = 8 inputs (one word) for 2 outputs; input i of output 0 has code i, of output 1 15 - i.
    intweight = torch.tensor([list(range(8)), [15 - i for i in range(8)]], dtype=torch.int32)
    scales = torch.ones(1, 8).half()
    zeros = torch.tensor([[8, 0, 1, 2, 3, 4, 5, 15]], dtype=torch.int32)
    packed = pack_gptq(intweight.repeat(4, 1), scales, zeros, None, 4)
    assert packed["qweight"].shape == (1, 8)
    assert packed["qweight"][0, 0].item() == 0x76543210
    assert packed["qweight"][0, 1].item() == 0x89ABCDEF - (1 << 32)
    # v1: the word 0xF543210 8 (zeros by output, low nibble first) minus 0x11111111
    assert packed["qzeros"].shape == (1, 1)
    want = (0xF5432108 - 0x11111111) % (1 << 32)
    assert packed["qzeros"][0, 0].item() % (1 << 32) == want
    v2 = pack_gptq(intweight.repeat(4, 1), scales, zeros, None, 4, checkpoint_format=GPTQ_V2)
    assert v2["qzeros"][0, 0].item() % (1 << 32) == 0xF5432108
    assert packed["g_idx"].dtype == torch.int32 and packed["scales"].dtype == torch.float16


def test_gptq_symmetric_v1_zero_is_seven() -> None:
    intweight, scales, _ = _random_layer(16, 64, 2, 4)
    zeros = torch.full((2, 16), 8, dtype=torch.int32)
    packed = pack_gptq(intweight, scales, zeros, None, 4)
    assert (packed["qzeros"] == 0x77777777).all()


def test_awq_words_by_hand() -> None:
    # One input row, 8 outputs with codes 0..7: nibble j holds output (0,2,4,6,1,3,5,7)[j].
    intweight = torch.arange(8, dtype=torch.int32).view(8, 1).repeat(1, 8)
    scales = torch.ones(1, 8).half()
    zeros = torch.arange(8, dtype=torch.int32).view(1, 8)
    packed = pack_awq(intweight, scales, zeros)
    assert packed["qweight"].shape == (8, 1)
    assert packed["qweight"][0, 0].item() == 0x75316420
    assert packed["qzeros"][0, 0].item() == 0x75316420


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("fmt", [GPTQ_V1, GPTQ_V2])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_round_trip(bits: int, fmt: str, desc_act: bool) -> None:
    out_f, in_f, group = 48, 96, 32
    intweight, scales, zeros = _random_layer(out_f, in_f, in_f // group, bits)
    g_idx = contiguous_g_idx(in_f, group)
    if desc_act:
        g_idx = g_idx[torch.randperm(in_f, generator=torch.Generator().manual_seed(1))]
    packed = pack_gptq(intweight, scales, zeros, g_idx, bits, checkpoint_format=fmt)
    assert packed["qweight"].shape == (in_f * bits // 32, out_f)
    assert packed["qzeros"].shape == (in_f // group, out_f * bits // 32)
    back = unpack_gptq(
        packed["qweight"],
        packed["qzeros"],
        packed["scales"],
        packed["g_idx"],
        bits,
        checkpoint_format=fmt,
    )
    assert torch.equal(back.intweight, intweight)
    assert torch.equal(back.zeros, zeros)  # zero points of 0 included (asymmetric)
    assert torch.equal(back.g_idx, g_idx)
    want = scales.float()[g_idx.long()].T * (intweight - zeros[g_idx.long()].T).float()
    got = dequantize_gptq(
        packed["qweight"],
        packed["qzeros"],
        packed["scales"],
        packed["g_idx"],
        bits,
        checkpoint_format=fmt,
    )
    assert torch.equal(got, want)


def test_awq_round_trip_and_dequantize() -> None:
    intweight, scales, zeros = _random_layer(40, 256, 2, 4)
    packed = pack_awq(intweight, scales, zeros)
    assert packed["qweight"].shape == (256, 5) and packed["qzeros"].shape == (2, 5)
    back = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"])
    assert torch.equal(back.intweight, intweight) and torch.equal(back.zeros, zeros)
    g = contiguous_g_idx(256, 128).long()
    want = scales.float()[g].T * (intweight - zeros[g].T).float()
    assert torch.equal(dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"]), want)


def test_bad_input_is_refused() -> None:
    intweight, scales, zeros = _random_layer(16, 64, 2, 4)
    with pytest.raises(ValueError, match="3-bit"):
        pack_gptq(intweight, scales, zeros, None, 3)
    with pytest.raises(ValueError, match="outside"):
        pack_gptq(intweight + 16, scales, zeros, None, 4)
    with pytest.raises(ValueError, match="integer codes"):
        pack_gptq(intweight.float(), scales, zeros, None, 4)
    with pytest.raises(ValueError, match="equal groups"):
        pack_gptq(intweight, scales[:1].repeat(3, 1), zeros[:1].repeat(3, 1), None, 4)
    with pytest.raises(ValueError, match="checkpoint_format"):
        pack_gptq(intweight, scales, zeros, None, 4, checkpoint_format="gptq_v3")
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_awq(intweight[:12], scales[:, :12], zeros[:, :12])
