"""Tensor parallel over gloo on quantized checkpoints: two ranks give the logits of one.

A tiny Llama is rounded to 4-bit codes and written as GPTQ (groups in order, and act-order
with scattered groups) and as AWQ GEMM; each is served by two processes (column-parallel
splits of the codes' outputs, row-parallel splits of their inputs cutting groups in two)
and by one, for a prefill and a mixed decode/prefill step.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from textgate.kernels.int4_linear import Int4PackedLinear
from textgate.kernels.packing import contiguous_g_idx, pack_awq, pack_gptq
from textgate.shard_server.models import load_model
from textgate.tests.tp_ranks import WORLD_SIZE, rank_outputs, spawn_ranks, step_logits

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (method, act-order, symmetric, dtype the model runs in)
CHECKPOINTS = {
    "gptq": ("gptq", False, False, torch.float32),
    "gptq-act-order": ("gptq", True, True, torch.float32),
    "awq": ("awq", False, False, torch.float32),
    # bf16: the CPU int4 kernel serves the column-parallel layers, sharded
    "gptq-act-order-bf16": ("gptq", True, False, torch.bfloat16),
}
# Of the largest logit (measured: bf16 strays 1.6%): all-reduce sums in another order, and
# bf16 rounds each rank's partial sum.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.03}


def round_to_codes(weight: torch.Tensor, g_idx: torch.Tensor, sym: bool):
    """Round-to-nearest 4-bit codes [out, in], scales and zeros [groups, out] of a weight."""
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, weight.shape[0])
    zeros = torch.empty(groups, weight.shape[0], dtype=torch.int32)
    for g in range(groups):
        cols = weight[:, g_idx == g]
        if sym:
            scales[g] = (cols.abs().max(dim=1).values / 7).clamp(min=1e-6)
            zeros[g] = 8
        else:
            low, high = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
            scales[g] = ((high - low) / 15).clamp(min=1e-6)
            zeros[g] = torch.round(-low / scales[g]).clamp(0, 15).to(torch.int32)
    g = g_idx.long()
    codes = torch.round(weight / scales[g].T + zeros[g].T).clamp(0, 15).to(torch.int32)
    return codes, scales, zeros


def quantization_config(method: str, act_order: bool, sym: bool) -> dict[str, object]:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
            "sym": sym, "checkpoint_format": "gptq"}  # fmt: skip


def write_checkpoint(float_dir: Path, out: Path, method: str, act_order: bool, sym: bool) -> None:
    """The float model in `float_dir` rounded to 4 bits and written in `method`'s layout."""
    tensors = {}
    for name, tensor in sorted(load_file(float_dir / "model.safetensors").items()):
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] not in LINEARS:
            tensors[name] = tensor
            continue
        g_idx = contiguous_g_idx(tensor.shape[1], GROUP)
        if act_order:  # layers reading one input share its order, as GPTQ's Hessian gives
            shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            gen = torch.Generator().manual_seed(zlib.crc32(shared.replace("up_", "gate_").encode()))
            g_idx = g_idx[torch.randperm(tensor.shape[1], generator=gen)]
        codes, scales, zeros = round_to_codes(tensor.float(), g_idx, sym)
        if method == "awq":
            layer = pack_awq(codes, scales, zeros)
        else:
            layer = pack_gptq(codes, scales, zeros, g_idx, 4)
        tensors |= {f"{prefix}.{part}": t for part, t in layer.items()}
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, act_order, sym)
    (out / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("tp-quantized")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,  # even: the head is vocab-parallel
        hidden_size=64,
        intermediate_size=96,  # down_proj's 96 inputs: 48 a rank, group 1 cut in two
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config.initializer_range = 0.2
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "float")
    paths = []
    for name, (method, act_order, sym, _) in CHECKPOINTS.items():
        write_checkpoint(root / "float", root / name, method, act_order, sym)
        paths.append(root / name)
    return paths


def run_steps(path: Path, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Float32 logits of each step of `tp_ranks.steps` for the quantized model in `path`."""
    method, _, _, dtype = CHECKPOINTS[path.name]
    model = load_model(path, dtype, "cpu", group)
    assert model.quantize == method
    if dtype == torch.bfloat16:
        assert any(isinstance(m, Int4PackedLinear) for m in model.modules())
    return [logits.float() for logits in step_logits(model)]


def test_two_ranks_match_one_on_gptq_and_awq(checkpoints, tmp_path):
    spawn_ranks(run_steps, checkpoints, tmp_path)
    for path in checkpoints:
        expected = run_steps(path, None)
        tol = TOLERANCE[CHECKPOINTS[path.name][3]]
        scale = max(step.abs().max().item() for step in expected)
        for rank in range(WORLD_SIZE):
            got = rank_outputs(tmp_path, path, rank)
            for step, (logits, reference) in enumerate(zip(got, expected, strict=True)):
                torch.testing.assert_close(
                    logits,
                    reference,
                    atol=tol * scale,
                    rtol=0,
                    msg=lambda m, where=f"{path.name} rank {rank} step {step}": f"{where}: {m}",
                )
