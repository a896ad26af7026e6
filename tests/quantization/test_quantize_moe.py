"""`textgate quantize --method gptq` on tiny random mixture-of-experts models (Mixtral,
Qwen2-MoE with its shared expert, Qwen3-MoE): each expert is calibrated on the tokens
routed to it, the checkpoint stores the experts under the names the shard loads, and the
shard serves it like its dequantized twin."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from textgate.cli import main
from textgate.quantization.algorithms.calibration import calibration_text_path, read_text
from textgate.quantization.algorithms.experts import ExpertInputs, layer_experts
from textgate.shard_server.layers.moe import LinearExperts
from textgate.shard_server.models import load_model
from textgate.tests.conftest import build_tiny_model
from textgate.tests.prefill import prefill_logits
from textgate.tests.quantization.test_quantize_cli import dequantized_reference, dequantized_state

# 256 calibration tokens: 128 per expert on average for Mixtral's and Qwen2-MoE's 4
# experts (top 2), 64 for Qwen3-MoE's 8, where --min-expert-tokens 64 makes some fall back.
CALIBRATION = ["--num-samples", "8", "--seq-len", "32", "--no-progress", "--group-size", "32"]
FLAGS = {"mixtral": [], "qwen2_moe": [], "qwen3_moe": ["--min-expert-tokens", "64"]}
NUM_EXPERTS = {"mixtral": 4, "qwen2_moe": 4, "qwen3_moe": 8}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, tiny_moe_model_dir: Path) -> dict[str, Path]:
    """Float checkpoints: 2 layers, hidden 64, 4 experts of which each token runs 2 (Qwen3-MoE
    the session's, 8 experts)."""
    root = tmp_path_factory.mktemp("moe")
    return {
        "mixtral": build_tiny_model(
            root / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": build_tiny_model(
            root / "qwen2_moe",
            "qwen2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        "qwen3_moe": tiny_moe_model_dir,
    }


def quantize(source: Path, out: Path, *flags: str) -> Path:
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", *flags, *CALIBRATION, str(source), str(out)])
    assert exit_info.value.code == 0
    return out


@pytest.fixture(scope="module")
def gptq(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-gptq")
    return {
        family: quantize(source, root / family, "--method", "gptq", *FLAGS[family])
        for family, source in sources.items()
    }


def text_tokens(source: Path, count: int) -> list[int]:
    """The start of the calibration text, as the model's tokenizer reads it."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = read_text(calibration_text_path())[:2000]
    return tokenizer(text, add_special_tokens=False)["input_ids"][:count]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("family", list(FLAGS))
def test_a_moe_checkpoint_serves_like_its_dequantized_twin(family, sources, gptq):
    native = load_model(gptq[family], torch.float32, "cpu")  # method auto-detected
    assert native.quantize == "gptq"
    experts = [m for m in native.modules() if isinstance(m, LinearExperts)]
    assert len(experts) == 2  # every layer's experts kept as quantized linears
    tokens = text_tokens(sources[family], 24)
    twin = dequantized_reference(gptq[family], sources[family])
    with torch.inference_mode():
        want = twin(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(native, tokens), want, rtol=0, atol=1e-4)


def test_experts_are_stored_one_linear_each_and_routers_stay_float(gptq):
    mixtral = load_file(gptq["mixtral"] / "model.safetensors")
    block = "model.layers.1.block_sparse_moe"
    for expert in range(4):
        for name, shape in (("w1", (8, 128)), ("w3", (8, 128)), ("w2", (16, 64))):
            prefix = f"{block}.experts.{expert}.{name}"
            assert mixtral[f"{prefix}.qweight"].shape == shape  # [in / 8, out]
            assert f"{prefix}.weight" not in mixtral
    assert mixtral[f"{block}.gate.weight"].dtype == torch.float16
    assert not [name for name in mixtral if ".mlp." in name or "gate.qweight" in name]
    qwen2 = load_file(gptq["qwen2_moe"] / "model.safetensors")
    mlp = "model.layers.0.mlp"
    assert f"{mlp}.shared_expert.down_proj.qweight" in qwen2
    assert f"{mlp}.experts.3.down_proj.qweight" in qwen2
    assert qwen2[f"{mlp}.shared_expert_gate.weight"].shape == (1, 64)
    assert qwen2[f"{mlp}.gate.weight"].shape == (4, 64)


@pytest.mark.parametrize("family", list(FLAGS))
def test_every_stored_linear_holds_its_float_namesakes_codes(family, sources, gptq):
    """Each quantized tensor dequantizes to the float checkpoint's tensor of the same name,
    within the 4-bit grid's error: no expert, nor gate and up, stored under another's name."""
    floats = load_file(sources[family] / "model.safetensors")
    quantized = {
        n.removesuffix(".qweight")
        for n in load_file(gptq[family] / "model.safetensors")
        if n.endswith(".qweight")
    }
    # Per layer: q/k/v/o, Qwen2-MoE's shared gate/up/down, and every expert's three.
    per_layer = 4 + (3 if family == "qwen2_moe" else 0) + 3 * NUM_EXPERTS[family]
    assert len(quantized) == 2 * per_layer
    state = dequantized_state(gptq[family])
    for prefix in quantized:
        name = f"{prefix}.weight"
        assert relative_error(state[name], floats[name]) < 0.15, name


def test_gptq_is_closer_to_the_float_model_than_rounding(sources, gptq, tmp_path):
    """On calibration text GPTQ's objective is the error it measures; round to nearest on
    the same grid is the bound it must beat (about 0.04 against 0.10 here)."""
    source = sources["mixtral"]
    rtn = quantize(source, tmp_path / "rtn", "--method", "rtn")
    tokens = text_tokens(source, 48)
    want = prefill_logits(load_model(source, torch.float32, "cpu"), tokens)
    gptq_error = relative_error(
        prefill_logits(load_model(gptq["mixtral"], torch.float32, "cpu"), tokens), want
    )
    rtn_error = relative_error(prefill_logits(load_model(rtn, torch.float32, "cpu"), tokens), want)
    assert gptq_error < 0.75 * rtn_error


def moe_inputs(source: Path, min_tokens: int) -> tuple[ExpertInputs, torch.Tensor]:
    """Layer 0's experts observed over random hidden states [200, 64] through its block."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    layer = model.model.layers[0]
    experts = layer_experts(layer)
    assert experts is not None
    inputs = ExpertInputs(experts, min_tokens)
    hidden = torch.randn(1, 200, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), inputs.observing():
        layer.mlp(hidden)
    return inputs, hidden[0]


def test_each_expert_is_calibrated_on_the_tokens_the_router_sends_it(sources):
    source = sources["mixtral"]
    inputs, hidden = moe_inputs(source, min_tokens=1)
    # The reference routing and weights from the checkpoint's own tensors (w1 gate, w3 up).
    saved = load_file(source / "model.safetensors")
    block = "model.layers.0.block_sparse_moe"
    chosen = torch.topk(hidden @ saved[f"{block}.gate.weight"].T, 2, dim=-1).indices  # [T, 2]
    for expert in range(4):
        rows = hidden[(chosen == expert).any(dim=-1)]
        assert inputs.num_tokens(expert) == len(rows) > 0
        w1, w3 = (saved[f"{block}.experts.{expert}.{w}.weight"] for w in ("w1", "w3"))
        middle = torch.nn.functional.silu(rows @ w1.T) * (rows @ w3.T)
        gate_up, down = inputs.hessians(expert)
        torch.testing.assert_close(gate_up, 2 * rows.T @ rows / len(rows), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(down, 2 * middle.T @ middle / len(rows), rtol=1e-4, atol=1e-5)


def test_an_expert_short_of_tokens_uses_every_tokens_inputs_and_is_logged(sources, caplog):
    inputs, hidden = moe_inputs(sources["mixtral"], min_tokens=1000)
    gate_up, down = inputs.hessians(0)
    torch.testing.assert_close(gate_up, 2 * hidden.T @ hidden / len(hidden), rtol=1e-4, atol=1e-5)
    assert torch.equal(down, torch.eye(128))
    with caplog.at_level(logging.WARNING, logger="textgate.quantization"):
        inputs.log_fallbacks("layer 0")
    assert "layer 0: 4 of 4 experts got fewer than 1000 calibration tokens" in caplog.text


def test_awq_refuses_a_mixture_of_experts(sources, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--method", "awq", *CALIBRATION, str(sources["mixtral"]), str(tmp_path)])
    assert exit_info.value.code == 2
    assert "AWQ of mixture-of-experts models is not supported" in capsys.readouterr().err
