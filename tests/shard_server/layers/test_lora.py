"""LoRA adapters on the native model against PEFT's own merged models: one adapter, a
step mixing three adapters and the base, the shard's loading and its refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.shard_server.layers.lora import (
    LoraAdapter,
    LoraError,
    LoraRows,
    attach,
    lora_rows,
)
from textgate.shard_server.models import load_model
from textgate.tests.shard_server.models.conftest import PagedRunner, build_tiny, reference_logits

peft = pytest.importorskip("peft")
# PEFT 0.21 still asks transformers 5.24 for the old name of a property.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "mlp-r16": {"r": 16, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "all-rs": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    },
}


def _prompt(length: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (length,), generator=generator).tolist()


def make_adapter(base: Path, out: Path, seed: int, **config: Any) -> torch.nn.Module:
    """A PEFT LoRA of the model in `base` with random (non-zero) A and B, saved to `out`;
    PEFT's merged model (transformers, float32) returned."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    lora.save_pretrained(out)
    return lora.merge_and_unload().eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora-base")
    build_tiny(path, "llama")
    return path


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (folder, PEFT's merged model)."""
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        name: (root / name, make_adapter(base, root / name, seed, **config))
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }


def native_with(base: Path, adapters: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, int]]:
    model = load_model(base, torch.float32, "cpu")
    loaded = [
        LoraAdapter.load(n, folder, torch.float32, torch.device("cpu"))
        for n, (folder, _) in adapters.items()
    ]
    return model, attach(model, loaded)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_an_adapter_gives_peft_merged_models_logits(base, adapters, name) -> None:
    model, slots = native_with(base, adapters)
    prompt = _prompt(11)
    runner = PagedRunner(model)
    with lora_rows(LoraRows.from_slots([slots[name]] * len(prompt), torch.device("cpu"))):
        logits = runner.step({0: prompt}, all_logits=True)[0]
    merged = adapters[name][1]
    torch.testing.assert_close(logits, reference_logits(merged, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-matmul", "per-adapter"])
def test_a_step_mixing_three_adapters_and_the_base_gives_each_its_own(
    base, adapters, grouped, monkeypatch
) -> None:
    from transformers import AutoModelForCausalLM

    from textgate.shard_server.layers import lora

    if not grouped:
        monkeypatch.setattr(lora, "grouped_mm_runs", lambda dtype, device: False)
    model, slots = native_with(base, adapters)
    layers = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]
    assert layers and all((layer._stacked is not None) == grouped for layer in layers)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    references = {0: plain} | {slots[n]: merged for n, (_, merged) in adapters.items()}
    prompts = {seq: _prompt(4 + seq, seed=seq) for seq in range(8)}
    slot_of = {seq: seq % 4 for seq in prompts}  # two sequences per adapter and base
    runner = PagedRunner(model)
    rows = [slot_of[seq] for seq, prompt in prompts.items() for _ in prompt]
    with lora_rows(LoraRows.from_slots(rows, torch.device("cpu"))):
        logits = runner.step(prompts, all_logits=True)
    for seq, prompt in prompts.items():
        expected = reference_logits(references[slot_of[seq]], prompt)
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=0, msg=f"seq {seq}")


def test_no_rows_means_the_base_alone(base, adapters) -> None:
    from transformers import AutoModelForCausalLM

    model, _ = native_with(base, adapters)
    prompt = _prompt(9)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    logits = PagedRunner(model).step({0: prompt}, all_logits=True)[0]
    torch.testing.assert_close(logits, reference_logits(plain, prompt), atol=1e-4, rtol=0)


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_what_cannot_apply_is_refused_by_name(base, adapters, tmp_path) -> None:
    import shutil

    folder = tmp_path / "dora"
    shutil.copytree(adapters["attn-r8"][0], folder)
    _edit_config(folder, use_dora=True)
    with pytest.raises(LoraError, match="'dora' sets use_dora"):
        LoraAdapter.load("dora", folder, torch.float32, torch.device("cpu"))
    with pytest.raises(LoraError, match=r"has no adapter_config\.json"):
        LoraAdapter.load("none", tmp_path, torch.float32, torch.device("cpu"))
    # An adapter of another base (a wider hidden size) does not fit this one's layers.
    other = tmp_path / "other-base"
    build_tiny(other, "llama", hidden_size=64)
    make_adapter(other, tmp_path / "wide", 0, r=4, target_modules=["q_proj"])
    model = load_model(base, torch.float32, "cpu")
    wide = LoraAdapter.load("wide", tmp_path / "wide", torch.float32, torch.device("cpu"))
    with pytest.raises(LoraError, match=r"'wide' layer 0 q_proj: A \(4, 64\)"):
        attach(model, [wide])


def test_the_shard_serves_adapters_and_refuses_unknown_ones(base, adapters) -> None:
    from textgate.proto import generate_pb2 as pb
    from textgate.shard_server.loading.shard_loader import load_model as load_shard
    from textgate.shard_server.startup.cache_config import CacheConfig
    from textgate.tests.conftest import build_tiny_model

    folder = build_tiny_model(base.parent / "with-tokenizer")  # a base with a tokenizer
    lora = folder.parent / "tok-lora"
    merged = make_adapter(folder, lora, 3, r=8, target_modules=["q_proj", "down_proj"])
    paged = load_shard(
        folder,
        "tiny",
        "float32",
        cache_config=CacheConfig(block_size=4),
        lora_adapters=[("mine", str(lora))],
    )
    assert paged.describe().lora_adapters == ["mine"]
    paged.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    prompt = [5, 17, 42, 8]

    def request(request_id: int, adapter: str) -> pb.Request:
        return pb.Request(
            id=request_id,
            input_ids=prompt,
            adapter_id=adapter,
            parameters=pb.NextTokenChooserParameters(
                temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0
            ),
            stopping_parameters=pb.StoppingCriteriaParameters(
                max_new_tokens=1, ignore_eos_token=True
            ),
        )

    plan = pb.StepPlan(
        scheduled=[
            pb.ScheduledRequest(
                request_id=1, token_ids=prompt, block_table=[0], produces_token=True
            ),
            pb.ScheduledRequest(
                request_id=2, token_ids=prompt, block_table=[1], produces_token=True
            ),
        ]
    )
    out = paged.step([request(1, "mine"), request(2, "")], plan)
    first = {g.request_id: g.tokens.ids[0] for g in out.generations}
    with torch.inference_mode():
        expected = int(merged(torch.tensor([prompt])).logits[0, -1].argmax())
    assert first[1] == expected
    unknown = paged.step([request(3, "theirs")], pb.StepPlan())
    assert "LoRA adapter 'theirs' is not loaded (loaded: mine)" in unknown.generations[0].error
