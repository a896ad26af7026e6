"""`--quantize gguf`: the embedded Q4_1 GGUF's linears read as codes, checked against the
folder transformers dequantized from the same file, and served by the int4 layers."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from textgate.kernels.int4_linear import Int4PackedLinear, build_quantized_linear
from textgate.kernels.packing import UnpackedWeight, contiguous_g_idx, dequantize
from textgate.paths import converted_from
from textgate.quantization.gguf import (
    GgufFile,
    GgufWeightsLoader,
    decode_q4,
    gguf_tensor_name,
    zero_points,
)
from textgate.quantization.resident import resident_bytes
from textgate.quantization.weights import Weights
from textgate.shard_server.loading import model_source
from textgate.shard_server.models import load_model
from textgate.tests.prefill import prefill_logits
from textgate.tests.tp_ranks import WORLD_SIZE, rank_outputs, spawn_ranks, step_logits

pytest.importorskip("gguf")


def test_blocks_decode_low_nibbles_first():
    # One Q4_1 block: d = 0.5, m = -1, codes 0..15 then 15..0; and one Q4_0 block, d = 2.
    codes = list(range(16)) + list(range(15, -1, -1))
    packed = bytes(codes[j] | codes[j + 16] << 4 for j in range(16))
    q4_1 = torch.tensor(list(struct.pack("<ee", 0.5, -1.0) + packed), dtype=torch.uint8)
    got, d, m = decode_q4(q4_1.reshape(1, 20), "Q4_1")
    assert got[0].tolist() == codes and d.item() == 0.5 and m.item() == -1.0
    q4_0 = torch.tensor(list(struct.pack("<e", 2.0) + packed), dtype=torch.uint8)
    got, d, m = decode_q4(q4_0.reshape(1, 18), "Q4_0")
    assert got[0].tolist() == codes and (d.item(), m.item()) == (2.0, -16.0)  # 2 (q - 8)


@pytest.mark.parametrize(("kind", "block_bytes"), [("Q4_0", 18), ("Q4_1", 20), ("Q4_K", 144)])
def test_decoding_matches_the_gguf_packages_dequantization(kind, block_bytes):
    # Random blocks (scales set to sane fp16 values), against gguf-py's reference.
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    generator = np.random.default_rng(len(kind) + block_bytes)
    raw = generator.integers(0, 256, (6, 3 * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(6, 3, block_bytes)
    halves = 2 if kind == "Q4_0" else 4  # d, and m (Q4_1) or dmin (Q4_K)
    scales = generator.uniform(-0.1, 0.1, (6, 3, halves // 2)).astype(np.float16)
    blocks[..., :halves] = scales.view(np.uint8).reshape(6, 3, halves)
    want = reference(raw, GGMLQuantizationType[kind])
    codes, d, m = decode_q4(torch.from_numpy(raw.copy()), kind)
    assert codes.shape == want.shape and int(codes.min()) >= 0 and int(codes.max()) <= 15
    got = codes.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_flat_groups_keep_their_value_through_every_layer_kind():
    # d = 0: the group is m whatever its codes. zero_points rewrites it (codes 0, a small
    # scale, z = -m / scale); dequantized and through the int4 kernel it is m again.
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (64, 64), generator=generator, dtype=torch.int32)
    d = torch.rand(64, 2, generator=generator) * 0.01 + 0.001
    m = -torch.rand(64, 2, generator=generator) * 0.05
    d[3, 1], d[7, 0], m[7, 0] = 0.0, 0.0, 0.0  # one flat group with m != 0, one all zero
    want = codes.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    new_codes, scales, zeros = zero_points(codes, d, m)
    assert bool((new_codes[3, 32:] == 0).all()) and bool(scales.ne(0).all())
    unpacked = UnpackedWeight(new_codes, scales.T, zeros.T, contiguous_g_idx(64, 32))
    torch.testing.assert_close(dequantize(unpacked), want, rtol=1e-5, atol=1e-7)
    layer = build_quantized_linear(unpacked, 4, torch.bfloat16)
    assert isinstance(layer, Int4PackedLinear)
    x = torch.randn(3, 64).bfloat16()
    want_out = x.float() @ want.T
    assert (layer(x).float() - want_out).abs().max() <= 2e-2 * want_out.abs().max()


def test_q4_0_zero_points_are_integers():
    codes = torch.zeros(2, 32, dtype=torch.int32)
    d = torch.tensor([[0.5], [0.25]])
    _, _, zeros = zero_points(codes, d, -8 * d)
    assert zeros.dtype == torch.int32 and zeros.unique().tolist() == [8]


def test_codes_go_to_the_models_device(gguf_file):
    # Decoded on the host, they must land where the folder's tensors do (CUDA in serving;
    # the meta device here, which any code path that forgets to move them would not reach).
    class OnMeta:
        device = torch.device("meta")

    loader = GgufWeightsLoader(gguf_file)
    unpacked = loader._read(OnMeta(), "model.layers.0.self_attn.q_proj", None, None)  # type: ignore[arg-type]
    assert {t.device.type for t in unpacked} == {"meta"}


def test_auto_measures_a_gguf_without_4_bit_linears(gguf_file, monkeypatch):
    from textgate.quantization import gptq

    monkeypatch.setattr(gptq, "has_bf16_arithmetic", lambda: True)
    loader = GgufWeightsLoader(gguf_file)
    assert loader.cpu_dtype() == torch.bfloat16
    monkeypatch.setitem(vars(gguf_file), "servable", frozenset())  # e.g. a Q8_0 file
    assert GgufWeightsLoader(gguf_file).cpu_dtype() is None


def test_module_names_map_to_gguf_tensors():
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q.weight"
    assert gguf_tensor_name("model.layers.0.mlp.down_proj") == "blk.0.ffn_down.weight"
    assert gguf_tensor_name("lm_head") is None


@pytest.fixture(scope="module")
def gguf_file(default_model_dir: Path) -> GgufFile:
    source = converted_from(default_model_dir)
    assert source is not None and source.name == model_source.EMBEDDED_GGUF
    return GgufFile(source)


@pytest.mark.parametrize("layer", [0, 29])
@pytest.mark.parametrize(
    "module",
    [
        *("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
        *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    ],
)
def test_codes_stand_for_the_folders_weights(gguf_file, default_model_dir, layer, module):
    # The folder holds transformers' dequantization of the same GGUF (q/k rows put back in
    # rotary order): our codes, scales and zero points give the same weights.
    prefix = f"model.layers.{layer}.{module}"
    codes, d, m = gguf_file.read(gguf_tensor_name(prefix))
    files = sorted(default_model_dir.glob("*.safetensors"))
    weights = Weights(files, device="cpu", dtype=torch.float32)
    folder = weights.get_tensor(f"{prefix}.weight")
    ours = codes.float() * d.repeat_interleave(32, dim=1) + m.repeat_interleave(32, dim=1)
    torch.testing.assert_close(ours, folder, rtol=0, atol=1e-6)
    # ... and so does the UnpackedWeight the loader builds from them (fractional zeros).
    zeros = -m / d
    unpacked = UnpackedWeight(codes, d.T, zeros.T, contiguous_g_idx(codes.shape[1], 32))
    torch.testing.assert_close(dequantize(unpacked), folder, rtol=0, atol=1e-5)


def test_gguf_model_keeps_its_linears_quantized_and_matches_the_folder(default_model_dir, caplog):
    # Same weights both ways: only bf16's rounding of the int4 kernel's scales and offsets
    # separates the two models.
    with caplog.at_level("INFO", logger="textgate.quantization"):
        quantized = load_model(default_model_dir, torch.bfloat16, "cpu", quantize="gguf")
    assert "210 of 210 linear layers kept as int4 codes; dequantized: none" in caplog.text
    assert quantized.quantize == "gguf"
    layer = quantized.layers[0].mlp.down_proj.linear
    assert isinstance(layer, Int4PackedLinear)
    dense = load_model(default_model_dir, torch.bfloat16, "cpu")
    tokens = list(range(100, 140))
    got, want = prefill_logits(quantized, tokens), prefill_logits(dense, tokens)
    assert (got - want).norm() / want.norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    # Linears at 4 bits (+ fp scales): well under the dense bf16 model's bytes.
    assert resident_bytes(quantized) < 0.7 * resident_bytes(dense)


def test_gguf_needs_a_model_converted_from_a_gguf(tiny_model_dir):
    with pytest.raises(ValueError, match="was not converted from one"):
        load_model(tiny_model_dir, torch.bfloat16, "cpu", quantize="gguf")


def test_a_gguf_model_id_is_converted_once_and_remembers_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TEXTGATE_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "my-model.gguf"
    shutil.copy(model_source.embedded_gguf_path(), copy)
    folder = model_source.resolve_model(str(copy))
    assert (folder / "config.json").is_file() and converted_from(folder) == copy
    assert model_source.resolve_model(str(copy)) == folder  # converted once


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_gguf_steps(path: Path, group: torch.distributed.ProcessGroup | None) -> list[torch.Tensor]:
    """Logits of `tp_ranks.steps` for the embedded model served with `--quantize gguf`, in
    float32 (the codes' slices dequantized) and in bf16 (the int4 kernel on each slice)."""
    outputs = []
    for name, dtype in DTYPES.items():
        model = load_model(path, dtype, "cpu", group, quantize="gguf")
        assert any(isinstance(m, Int4PackedLinear) for m in model.modules()) == (name == "bf16")
        outputs += [logits.float() for logits in step_logits(model)]
    return outputs


def test_two_ranks_match_one_on_the_gguf_codes(default_model_dir, tmp_path):
    # 9 query heads and 3 kv heads split 5/4 and 2/1 (column-parallel), 576 and 1536 inputs
    # split in halves of whole blocks (row-parallel); two steps per dtype.
    spawn_ranks(run_gguf_steps, [default_model_dir], tmp_path)
    expected = run_gguf_steps(default_model_dir, None)
    for rank in range(WORLD_SIZE):
        got = rank_outputs(tmp_path, default_model_dir, rank)
        for index, (logits, reference) in enumerate(zip(got, expected, strict=True)):
            if index < 2:  # float32: the all-reduce only sums in another order
                scale = reference.abs().max().item()
                torch.testing.assert_close(logits, reference, atol=1e-4 * scale, rtol=0)
            else:  # bf16 rounds each rank's partial sums, through 30 layers: the unquantized
                # bf16 model's own two ranks stray 2.5% from one, and flip near-ties
                assert (logits - reference).norm() / reference.norm() < 0.05
                # Where the argmax differs it is a near-tie in one shard's logits: on a
                # Sapphire Rapids Xeon 2 of 19 rows flipped, 0.125 (one bf16 step) below
                # the top, against a spread (std) of ~3 over the vocabulary.
                picked = reference.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
                margin = reference.max(-1).values - picked
                assert (margin <= 0.1 * reference.std(-1)).all(), margin


def test_a_fused_layer_of_mixed_types_is_fused_in_float(gguf_file, default_model_dir, monkeypatch):
    # Q4_K_M files store some v projections as Q6_K beside a Q4_K q and k.
    from textgate.quantization.unquantized import UnquantizedWeight

    monkeypatch.setitem(vars(gguf_file), "servable", gguf_file.servable - {"blk.0.attn_v.weight"})
    files = sorted(default_model_dir.glob("*.safetensors"))
    weights = Weights(files, device="cpu", dtype=torch.float32)
    loader = GgufWeightsLoader(gguf_file)
    parts = [f"model.layers.0.self_attn.{n}_proj" for n in ("q", "k", "v")]
    assert isinstance(loader.get_multi_weights_col(weights, parts, 0), UnquantizedWeight)
    parts = [f"model.layers.1.self_attn.{n}_proj" for n in ("q", "k", "v")]
    assert not isinstance(loader.get_multi_weights_col(weights, parts, 0), UnquantizedWeight)
