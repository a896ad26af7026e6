"""LoRA adapters under tensor parallelism over gloo: each of two ranks holds its share of
every update (B's rows by head or feature, A's columns), and a step mixing three adapters
and the base gives one rank's logits and PEFT's merged models', before and after an
adapter is unloaded and loaded again on every rank; on Phi-3 too, whose adapters name the
fused `qkv_proj` and `gate_up_proj` (each B cut into its parts, each part by rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from textgate.shard_server.layers.lora import LoraRows, lora_rows
from textgate.shard_server.layers.lora_slots import LoraSlots
from textgate.shard_server.models import load_model
from textgate.tests.shard_server.models.conftest import PagedRunner, build_tiny, reference_logits
from textgate.tests.tp_ranks import WORLD_SIZE, rank_outputs, spawn_ranks

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

# Splits the even ones would get wrong: 3 kv heads over 2 ranks (2 and 1, their query
# groups with them) and 37 intermediate features (19 and 18); one kv head on both ranks.
BASES = {
    "uneven": (
        "llama",
        {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 37},
    ),
    "mqa": ("llama", {"num_key_value_heads": 1, "intermediate_size": 37}),
    "phi3": ("phi3", {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 37}),
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ATTENTION},
    "all-r16": {"r": 16, "lora_alpha": 32, "target_modules": ATTENTION + MLP},
    "mlp-rs": {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": MLP},
}
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PHI3_ADAPTERS = {  # the same names, so that NAMES serves both
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj"]},
    "all-r16": {"r": 16, "lora_alpha": 32, "target_modules": FUSED},
    "mlp-rs": {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["gate_up_proj"]},
}
PROMPTS = {
    seq: torch.randint(0, 101, (5 + seq,), generator=torch.Generator().manual_seed(seq)).tolist()
    for seq in range(4)
}
NAMES: dict[int, str | None] = {0: None, 1: "attn-r8", 2: "all-r16", 3: "mlp-rs"}
DECODED = [7, 9]  # each sequence's next two tokens, fed one step at a time


def adapter_folder(base: Path, name: str) -> Path:
    return base.with_name(f"{base.name}-{name}")


def _step(runner: PagedRunner, slots: LoraSlots, chunks: dict[int, list[int]]) -> torch.Tensor:
    """One step of `chunks`, sequence s on adapter NAMES[s]: all rows' logits, in order."""
    rows = [slots.slots.get(NAMES[seq] or "", 0) for seq, tokens in chunks.items() for _ in tokens]
    with lora_rows(LoraRows.from_slots(rows, torch.device("cpu"))):
        logits = runner.step(chunks, all_logits=True)
    return torch.cat(list(logits.values()))


def run_mixed(base: Path, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The prefill of every prompt, then a decode step, each mixing the three adapters and
    the base; then `attn-r8` unloaded, loaded again and a second decode step."""
    model = load_model(base, torch.float32, "cpu", group)
    slots = LoraSlots(model)
    for name in NAMES.values():  # LoadAdapter's read and attach
        if name is None:
            continue
        slots.load(name, adapter_folder(base, name))
    runner = PagedRunner(model)
    outputs = [_step(runner, slots, PROMPTS)]
    outputs.append(_step(runner, slots, {seq: DECODED[:1] for seq in PROMPTS}))
    slots.unload("attn-r8")
    slots.load("attn-r8", adapter_folder(base, "attn-r8"))
    outputs.append(_step(runner, slots, {seq: DECODED[1:] for seq in PROMPTS}))
    return outputs


def peft_expected(merged: dict[str | None, Any]) -> list[torch.Tensor]:
    """`run_mixed`'s logits as PEFT's merged models (transformers without a cache) give them."""
    full = {seq: reference_logits(merged[NAMES[seq]], p + DECODED) for seq, p in PROMPTS.items()}
    prefill = torch.cat([full[seq][: len(p)] for seq, p in PROMPTS.items()])
    first = torch.stack([full[seq][len(p)] for seq, p in PROMPTS.items()])
    return [prefill, first, torch.stack([full[seq][-1] for seq in PROMPTS])]


def _bases(tmp_path: Path) -> dict[Path, dict[str | None, Any]]:
    """Each base folder with its adapters saved beside it: name -> PEFT's merged model."""
    from transformers import AutoModelForCausalLM

    from textgate.tests.shard_server.layers.test_lora import make_adapter

    made = {}
    for base_name, (kind, overrides) in BASES.items():
        base = tmp_path / base_name
        build_tiny(base, kind, **overrides)
        merged: dict[str | None, Any] = {
            None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        }
        adapters = PHI3_ADAPTERS if kind == "phi3" else ADAPTERS
        for seed, (name, config) in enumerate(adapters.items()):
            merged[name] = make_adapter(base, adapter_folder(base, name), seed, **config)
        made[base] = merged
    return made


def test_two_ranks_give_one_ranks_and_peft_logits_for_a_mixed_step(tmp_path: Path) -> None:
    bases = _bases(tmp_path)
    out = tmp_path / "ranks"
    out.mkdir()
    spawn_ranks(run_mixed, list(bases), out)
    for base, merged in bases.items():
        alone = run_mixed(base, None)
        for step, (one, peft_logits) in enumerate(zip(alone, peft_expected(merged), strict=True)):
            message = f"{base.name} step {step}"
            torch.testing.assert_close(one, peft_logits, atol=1e-4, rtol=0, msg=message)
            for rank in range(WORLD_SIZE):
                got = rank_outputs(out, base, rank)[step]
                torch.testing.assert_close(
                    got, one, atol=1e-4, rtol=0, msg=f"{message} rank {rank}"
                )
