"""A tiny random Llama written in GPTQ layout loads through the shard's model loader and
gives the logits of the same model with its weights dequantized to floating point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from textgate.kernels.int4_linear import Int4PackedLinear
from textgate.kernels.packing import contiguous_g_idx, dequantize_gptq, pack_gptq
from textgate.shard_server.models import load_model
from textgate.tests.prefill import prefill_logits

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32


def rtn_gptq(weight: torch.Tensor, desc_act: bool, seed: int) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit GPTQ tensors of a float weight [out, in]."""
    out_f, in_f = weight.shape
    g_idx = contiguous_g_idx(in_f, GROUP)
    if desc_act:
        g_idx = g_idx[torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))]
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, out_f)
    zeros = torch.empty(groups, out_f, dtype=torch.int32)
    for g in range(groups):
        cols = weight[:, g_idx == g]
        low, high = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
        scales[g] = ((high - low) / 15).clamp(min=1e-6)
        zeros[g] = torch.round(-low / scales[g]).clamp(0, 15).to(torch.int32)
    intweight = torch.round(weight / scales[g_idx.long()].T + zeros[g_idx.long()].T)
    return pack_gptq(intweight.clamp(0, 15).to(torch.int32), scales, zeros, g_idx, 4)


def write_pair(root: Path, desc_act: bool) -> tuple[Path, Path]:
    """The same tiny model twice: GPTQ layout, and its dequantized floating-point twin."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config)
    float_dir, gptq_dir = root / "float", root / "gptq"
    model.save_pretrained(float_dir)
    tensors = load_file(float_dir / "model.safetensors")
    quantized, dequantized = {}, {}
    for seed, (name, tensor) in enumerate(sorted(tensors.items())):
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] not in LINEARS:
            quantized[name] = dequantized[name] = tensor
            continue
        layer = rtn_gptq(tensor, desc_act, seed)
        quantized |= {f"{prefix}.{part}": t for part, t in layer.items()}
        dequantized[name] = dequantize_gptq(**layer, bits=4)
    save_file(dequantized, float_dir / "model.safetensors")
    gptq_dir.mkdir()
    save_file(quantized, gptq_dir / "model.safetensors")
    hf_config = json.loads((float_dir / "config.json").read_text())
    hf_config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": desc_act,
        "sym": False,
        "checkpoint_format": "gptq",
    }
    (gptq_dir / "config.json").write_text(json.dumps(hf_config))
    return float_dir, gptq_dir


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoint_matches_its_dequantized_twin(tmp_path, desc_act):
    float_dir, gptq_dir = write_pair(tmp_path, desc_act)
    tokens = torch.randint(0, 101, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    want = prefill_logits(load_model(float_dir, torch.float32, "cpu"), tokens)
    got = prefill_logits(load_model(gptq_dir, torch.float32, "cpu"), tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # bf16: the layers are the int4 kernel's; same logits up to bf16 rounding
    fast = load_model(gptq_dir, torch.bfloat16, "cpu")
    assert any(isinstance(m, Int4PackedLinear) for m in fast.modules())
    got16 = prefill_logits(fast, tokens)
    want16 = prefill_logits(load_model(float_dir, torch.bfloat16, "cpu"), tokens)
    assert (got16 - want16).abs().max().item() <= 0.05 * want16.abs().max().item()
