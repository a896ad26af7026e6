"""`textgate quantize` on a tiny random Llama: every method writes a checkpoint in its
standard layout that the shard's loaders read back and generate from."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from textgate.cli import build_parser, main
from textgate.kernels import AttentionMetadata
from textgate.kernels.packing import dequantize_awq, dequantize_gptq
from textgate.shard_server.models import load_model

CALIBRATION = ["--num-samples", "4", "--seq-len", "32", "--no-progress"]
METHODS = {
    "rtn": ["--method", "rtn"],
    "gptq": ["--method", "gptq"],
    "gptq-act-order-sym": ["--method", "gptq", "--desc-act", "--sym"],
    "awq": ["--method", "awq"],
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Path:
    """The session's tiny random Llama (read only here)."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def checkpoints(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    for name, flags in METHODS.items():
        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    "quantize",
                    *flags,
                    "--group-size",
                    "32",
                    *CALIBRATION,
                    str(tiny),
                    str(root / name),
                ]
            )
        assert exit_info.value.code == 0
    return {name: root / name for name in METHODS}


def dequantized_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name in float32, each quantized linear as its dequantized
    `<prefix>.weight`."""
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    tensors = load_file(checkpoint / "model.safetensors")
    state = {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "qweight" and config["quant_method"] == "awq":
            state[f"{prefix}.weight"] = dequantize_awq(
                tensor, tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"]
            )
        elif suffix == "qweight":
            state[f"{prefix}.weight"] = dequantize_gptq(
                tensor,
                tensors[f"{prefix}.qzeros"],
                tensors[f"{prefix}.scales"],
                tensors[f"{prefix}.g_idx"],
                config["bits"],
            )
        elif suffix not in ("qzeros", "scales", "g_idx"):
            state[name] = tensor.float()
    return state


def dequantized_reference(checkpoint: Path, tiny: Path) -> torch.nn.Module:
    """The tiny model in transformers with the checkpoint's weights dequantized to floats.

    They are saved under the checkpoint's own names beside the float config and loaded as
    a checkpoint, so transformers maps them as it maps any (a MoE's experts fused)."""
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(tiny / "config.json", folder)
        save_file(dequantized_state(checkpoint), Path(folder) / "model.safetensors")
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy_native(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the native model: one prefill, then one decode step per token."""
    cache = model.allocate_kv_cache(num_blocks=4, block_size=16)
    tokens, new = list(prompt), list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            metadata = AttentionMetadata.build(
                query_lens=[len(new)],
                context_lens=[len(tokens) - len(new)],
                block_tables=[[0, 1, 2, 3]],
                block_size=16,
            )
            rows = torch.tensor([len(new) - 1])
            logits = model(torch.tensor(new), metadata.positions(), cache, metadata, rows)
            new = [int(logits[0].argmax())]
            tokens += new
    return tokens[len(prompt) :]


def assert_generates_like_dequantized_twin(
    native: torch.nn.Module, checkpoint: Path, source: Path
) -> None:
    """Six greedy tokens of the loaded checkpoint equal transformers' over its weights
    dequantized (the same numbers, without textgate's kernels)."""
    reference = dequantized_reference(checkpoint, source)
    prompt = [5, 17, 42, 8, 99, 3]
    with torch.inference_mode():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert greedy_native(native, prompt, 6) == expected


@pytest.mark.parametrize("name", list(METHODS))
def test_checkpoint_loads_in_the_shard_and_generates_like_its_dequantized_twin(
    name, checkpoints, tiny
):
    checkpoint = checkpoints[name]
    native = load_model(checkpoint, torch.float32, "cpu")  # method auto-detected
    expected_method = "awq" if name == "awq" else "gptq"
    assert native.quantize == expected_method
    assert_generates_like_dequantized_twin(native, checkpoint, tiny)


def test_gptq_layout_and_configs(checkpoints):
    folder = checkpoints["gptq-act-order-sym"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["checkpoint_format"] == "gptq"
    assert (config["bits"], config["group_size"], config["desc_act"], config["sym"]) == (
        4,
        32,
        True,
        True,
    )
    assert json.loads((folder / "quantize_config.json").read_text())["desc_act"] is True
    tensors = load_file(folder / "model.safetensors")
    # q_proj: 64 inputs, 64 outputs, groups of 32.
    prefix = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{prefix}.qweight"].shape == (8, 64)
    assert tensors[f"{prefix}.qzeros"].shape == (2, 8)
    assert tensors[f"{prefix}.scales"].dtype == torch.float16
    g_idx = tensors[f"{prefix}.g_idx"]
    assert g_idx.tolist() != sorted(g_idx.tolist())  # act-order permuted the groups
    assert torch.bincount(g_idx.long()).tolist() == [32, 32]
    assert f"{prefix}.weight" not in tensors
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.float16


def test_awq_layout_and_configs(checkpoints, tiny):
    folder = checkpoints["awq"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert json.loads((folder / "quant_config.json").read_text())["version"] == "GEMM"
    tensors = load_file(folder / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (128, 8)  # [in, out / 8]
    assert "model.layers.0.mlp.down_proj.g_idx" not in tensors
    # The activation scales were folded into the norms: they differ from the float model.
    original = load_file(tiny / "model.safetensors")["model.layers.0.input_layernorm.weight"]
    folded = tensors["model.layers.0.input_layernorm.weight"].float()
    assert not torch.allclose(original, folded, atol=1e-2)


def test_tokenizer_and_generation_files_are_copied(checkpoints, tiny):
    copied = {p.name for p in checkpoints["rtn"].iterdir()}
    assert {p.name for p in tiny.iterdir() if p.suffix != ".safetensors"} <= copied


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "awq", "--sym"], "AWQ's GEMM layout is 4-bit with zero points"),
        (["--method", "rtn", "--desc-act"], "--desc-act"),
        (["--method", "gptq", "--bits", "3"], "bits"),
        (["--method", "awq", "--group-size", "48"], "--group-size 64 fits every layer"),
    ],
)
def test_bad_options_are_clear_errors(flags, message, tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", *flags, *CALIBRATION, str(tiny), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_existing_output_folder_is_refused(tiny, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["quantize", "--method", "rtn", "--no-progress", str(tiny), str(tmp_path / "out")])
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_model_may_be_left_out_for_the_default():
    args = build_parser().parse_args(["quantize", "--method", "rtn", "out"])
    assert args.model is None and args.out == Path("out")
    args = build_parser().parse_args(["quantize", "--method", "gptq", "default", "out"])
    assert args.model == "default"


def test_a_tiny_qwen3_quantizes_and_serves_like_its_dequantized_twin(tmp_path):
    from textgate.tests.conftest import build_tiny_model

    qwen3 = build_tiny_model(tmp_path / "qwen3", "qwen3", head_dim=16)
    out = tmp_path / "qwen3-gptq"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "quantize",
                "--method",
                "gptq",
                "--group-size",
                "32",
                *CALIBRATION,
                str(qwen3),
                str(out),
            ]
        )
    assert exit_info.value.code == 0
    native = load_model(out, torch.float32, "cpu")
    assert native.quantize == "gptq" and native.config.qk_norm
    assert_generates_like_dequantized_twin(native, out, qwen3)
