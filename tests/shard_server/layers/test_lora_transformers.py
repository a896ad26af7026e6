"""LoRA adapters on a model run by transformers' own modules on the paged engine (Olmo 2,
which has no native class): each update joins its linear layer's output through a forward
hook; a step mixing two adapters and the base equals PEFT's merged models, the shard loads
them at startup and over gRPC, and what cannot apply is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.kernels import get_attention_backend
from textgate.shard_server.layers.lora import LoraRows, lora_rows
from textgate.shard_server.layers.lora_adapter import LoraError
from textgate.shard_server.layers.lora_limits import LoraLimits
from textgate.shard_server.layers.lora_slots import LoraSlots
from textgate.shard_server.models.transformers_paged import TransformersPagedModel
from textgate.tests.shard_server.layers.test_lora import _prompt, make_adapter
from textgate.tests.shard_server.models.conftest import PagedRunner, reference_logits
from textgate.tests.shard_server.models.test_transformers_paged import build

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "mlp": {"r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
}


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str | None, Any]]:
    """A tiny Olmo 2 and its adapters beside it: name -> PEFT's merged model (None: plain)."""
    base = tmp_path_factory.mktemp("olmo2")
    plain = build(base, "olmo2")
    merged: dict[str | None, Any] = {None: plain}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        merged[name] = make_adapter(base, base.with_name(f"{base.name}-{name}"), seed, **config)
    return base, merged


def test_a_step_mixing_two_adapters_and_the_base_gives_each_its_own(olmo2) -> None:
    base, merged = olmo2
    model = TransformersPagedModel.load(base, torch.float32, "cpu", get_attention_backend("cpu"))
    slots = LoraSlots(model, LoraLimits(max_loras=2))
    for name in ADAPTERS:
        slots.load(name, base.with_name(f"{base.name}-{name}"))
    names = {0: None, 1: "attn", 2: "mlp", 3: "attn", 4: None}
    prompts = {seq: _prompt(4 + seq, seed=seq) for seq in names}
    runner = PagedRunner(model, block_size=4)
    rows = [slots.slot_of(names[seq] or "") for seq, p in prompts.items() for _ in p]
    with lora_rows(LoraRows.from_slots(rows, torch.device("cpu"))):
        logits = runner.step(prompts, all_logits=True)
    for seq, prompt in prompts.items():
        expected = reference_logits(merged[names[seq]], prompt)
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=0, msg=f"seq {seq}")
        if names[seq] is not None:  # the update changed the answer: it was applied
            assert (expected - reference_logits(merged[None], prompt)).abs().max() > 1e-2
    slots.reside(["mlp"])  # evicted: its rows run the base again, through the same hook
    with lora_rows(LoraRows.from_slots([0] * len(prompts[1]), torch.device("cpu"))):
        again = runner.step({9: prompts[1]}, all_logits=True)[9]
    torch.testing.assert_close(again, reference_logits(merged[None], prompts[1]), atol=1e-4, rtol=0)


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")
def test_what_cannot_apply_is_refused_by_name(olmo2, tmp_path) -> None:
    base, _ = olmo2
    model = TransformersPagedModel.load(base, torch.float32, "cpu", get_attention_backend("cpu"))
    slots = LoraSlots(model)
    make_adapter(base, tmp_path / "head", 0, r=4, target_modules=["lm_head"])
    with pytest.raises(LoraError, match=r"'head' targets lm_head, the output head"):
        slots.read("head", tmp_path / "head")
    other = tmp_path / "other"
    build(other, "olmo2", hidden_size=64)
    make_adapter(other, tmp_path / "wide", 0, r=4, target_modules=["q_proj"])
    with pytest.raises(LoraError, match=r"'wide' model.layers.0.self_attn.q_proj: A \(4, 64\)"):
        slots.read("wide", tmp_path / "wide")


def test_the_shard_serves_adapters_at_startup_on_the_transformers_path(olmo2, tmp_path) -> None:
    from textgate.proto import generate_pb2 as pb
    from textgate.shard_server.loading.shard_loader import load_model as load_shard
    from textgate.shard_server.startup.cache_config import CacheConfig
    from textgate.tests.conftest import build_tiny_model
    from textgate.tests.shard_server.conftest import make_request

    folder = build_tiny_model(tmp_path / "base", "olmo2")
    merged = make_adapter(folder, tmp_path / "mine", 3, r=8, target_modules=["q_proj", "up_proj"])
    paged = load_shard(
        folder,
        "tiny-olmo2",
        "float32",
        cache_config=CacheConfig(block_size=4),
        lora_adapters=[("mine", str(tmp_path / "mine"))],
    )
    assert isinstance(paged.model, TransformersPagedModel)
    info = paged.describe()
    assert (list(info.lora_adapters), list(info.resident_lora_adapters)) == (["mine"], ["mine"])
    paged.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    prompt = [5, 17, 42, 8]
    requests = [make_request(i, prompt, 1) for i in (1, 2)]
    requests[0].adapter_id = "mine"
    plan = pb.StepPlan(
        scheduled=[
            pb.ScheduledRequest(
                request_id=i, token_ids=prompt, block_table=[i], produces_token=True
            )
            for i in (1, 2)
        ]
    )
    tokens = {g.request_id: g.tokens for g in paged.step(requests, plan).generations}
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plain = reference_logits(base_model, prompt)[-1]
    adapted = reference_logits(merged, prompt)[-1]
    for request_id, logits in ((1, adapted), (2, plain)):
        expected = torch.log_softmax(logits, -1)
        got = tokens[request_id]
        assert got.ids[0] == int(logits.argmax())
        assert got.logprobs[0] == pytest.approx(float(expected[got.ids[0]]), abs=1e-4)
