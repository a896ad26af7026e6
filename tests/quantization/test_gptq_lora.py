"""LoRA adapters over a GPTQ base from `textgate quantize --method gptq`: a step mixing two
adapters and the base gives, row by row, the logits of transformers over the checkpoint's
weights dequantized (its twin) with PEFT's adapter merged; on two ranks, one rank's.

The bound is float32's 1e-4: on the CPU the 4-bit layers run on their dequantized float32
weights, so the twin is the same numbers in another order (the test checks the base rows
against the twin too, so a looser kernel would show there first)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from textgate.cli import main
from textgate.shard_server.layers.lora import LoraRows, lora_rows
from textgate.shard_server.layers.lora_slots import LoraSlots
from textgate.shard_server.models import load_model
from textgate.tests.quantization.test_quantize_cli import CALIBRATION, dequantized_state
from textgate.tests.shard_server.models.conftest import PagedRunner, reference_logits
from textgate.tests.tp_ranks import WORLD_SIZE, rank_outputs, spawn_ranks

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ATTENTION},
    "all-r16": {"r": 16, "lora_alpha": 32, "target_modules": ATTENTION + MLP},
}
# Sequence -> its adapter (None: the base), two sequences each.
NAMES: dict[int, str | None] = {seq: [None, *ADAPTERS][seq % 3] for seq in range(6)}
PROMPTS = {seq: [5 + seq, 17, 42, 8, 99 - seq, 3][: 3 + seq % 4] for seq in NAMES}


@pytest.fixture(scope="module")
def gptq(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny Llama quantized by `textgate quantize --method gptq`, with its
    dequantized twin (a float checkpoint) beside it as `gptq-twin`."""
    out = tmp_path_factory.mktemp("gptq-lora") / "gptq"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "quantize",
                "--method",
                "gptq",
                "--group-size",
                "32",
                *CALIBRATION,
                str(tiny_model_dir),
                str(out),
            ]
        )
    assert exit_info.value.code == 0
    twin = out.with_name("gptq-twin")
    twin.mkdir()
    shutil.copy(tiny_model_dir / "config.json", twin)
    save_file(dequantized_state(out), twin / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def merged(gptq: Path) -> dict[str | None, Any]:
    """Adapter name -> the twin with PEFT's adapter merged (None: the twin); the adapters,
    made on the twin (the same names and shapes as the checkpoint's), saved beside it."""
    from textgate.tests.shard_server.layers.test_lora import make_adapter

    twin = gptq.with_name("gptq-twin")
    merged: dict[str | None, Any] = {
        None: AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    }
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        merged[name] = make_adapter(twin, gptq.with_name(f"gptq-{name}"), seed, **config)
    return merged


def run_mixed(checkpoint: Path, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every prompt's all-row logits from one step mixing the adapters and the base."""
    model = load_model(checkpoint, torch.float32, "cpu", group)
    assert model.quantize == "gptq"
    slots = LoraSlots(model)
    for name in ADAPTERS:
        slots.load(name, checkpoint.with_name(f"gptq-{name}"))
    rows = [slots.slots.get(NAMES[seq] or "", 0) for seq, p in PROMPTS.items() for _ in p]
    with lora_rows(LoraRows.from_slots(rows, torch.device("cpu"))):
        logits = PagedRunner(model).step(PROMPTS, all_logits=True)
    return [logits[seq] for seq in PROMPTS]


def test_adapters_over_gptq_give_the_dequantized_twin_with_peft_merged(
    gptq: Path, merged: dict[str | None, Any]
) -> None:
    got = run_mixed(gptq, None)
    for (seq, prompt), logits in zip(PROMPTS.items(), got, strict=True):
        expected = reference_logits(merged[NAMES[seq]], prompt)
        message = f"seq {seq} on {NAMES[seq] or 'the base'}"
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=message)
        if NAMES[seq] is not None:  # an adapter moves the logits far past the bound
            base = reference_logits(merged[None], prompt)
            assert (expected - base).abs().max() > 1e-2, message


def test_adapters_over_gptq_on_two_ranks_give_one_ranks_logits(
    gptq: Path, merged: dict[str | None, Any], tmp_path: Path
) -> None:
    spawn_ranks(run_mixed, [gptq], tmp_path)
    alone = run_mixed(gptq, None)
    for rank in range(WORLD_SIZE):
        got = rank_outputs(tmp_path, gptq, rank)
        for seq, (logits, one) in enumerate(zip(got, alone, strict=True)):
            message = f"rank {rank} seq {seq}"
            torch.testing.assert_close(logits, one, atol=1e-4, rtol=0, msg=message)
