"""LoRA adapters on the native model against PEFT's own merged models: one adapter, a
step mixing three adapters and the base, the shard's loading and its refusals, adapters
loaded and unloaded on a live model (and over the shard's gRPC)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.shard_server.layers.lora import LoraLayer, LoraRows, attach, lora_rows
from textgate.shard_server.layers.lora_adapter import LoraAdapter, LoraError
from textgate.shard_server.layers.lora_limits import LoraLimits
from textgate.shard_server.layers.lora_slots import LoraSlots
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


@pytest.mark.parametrize("path", ["batched", "dense", "grouped-matmul", "per-adapter"])
def test_a_step_mixing_three_adapters_and_the_base_gives_each_its_own(
    base, adapters, path, monkeypatch
) -> None:
    from transformers import AutoModelForCausalLM

    from textgate.shard_server.layers import lora

    stacked = path != "per-adapter"
    if path != "batched":  # the CPU's path; the others are the GPU's, run here on the CPU
        monkeypatch.setattr(lora, "BATCHED_DEVICES", ())
    if path not in ("batched", "dense"):  # the step's 60 rows run densely unless told otherwise
        monkeypatch.setattr(lora, "DENSE_MAX_ROWS", 0)
    if path == "per-adapter":
        monkeypatch.setattr(lora, "grouped_mm_runs", lambda dtype, device: False)
    model, slots = native_with(base, adapters)
    layers = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]
    assert layers and all((layer.stacked() is not None) == stacked for layer in layers)
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


@pytest.mark.parametrize(
    "slots",
    [
        [1, 2, 4, 1, 2, 4] * 4,  # every row on an adapter, evenly: no padding
        [1, 0, 4, 1, 5, 1, 1, 0, 4, 5, 1, 0, 1],  # padding, slot 2 unused, slot 5 past the layer
        [4, 0, 4],  # only slot 4, whose adapter this layer lacks (zero updates)
        [0, 5, 5],  # no row on a slot of the layer: the base alone
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batched_path_equals_one_pair_of_matmuls_per_adapter(slots, dtype, monkeypatch):
    from textgate.shard_server.layers import lora

    generator = torch.Generator().manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    layer = LoraLayer(24)
    for slot, rank in ((1, 8), (2, 4), (3, 16)):  # slot 3 takes the first 8 outputs only
        layer.updates[slot] = [
            (0, 8 if slot == 3 else 24, randn(rank, 20), randn(8 if slot == 3 else 24, rank), 0.5)
        ]
    x, base = randn(len(slots), 20), randn(len(slots), 24)
    rows = LoraRows.from_slots(slots, torch.device("cpu"))
    with lora_rows(rows):
        got = layer.add(x, base.clone())
        monkeypatch.setattr(lora, "BATCHED_DEVICES", ())
        monkeypatch.setattr(lora, "DENSE_MAX_ROWS", 0)
        monkeypatch.setattr(lora, "grouped_mm_runs", lambda dtype, device: False)
        layer.fuse()
        want = layer.add(x, base.clone())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    on_layer = [row for row, slot in enumerate(slots) if slot in (1, 2, 3)]
    untouched = [row for row in range(len(slots)) if row not in on_layer]
    assert torch.equal(got[untouched], base[untouched])
    assert not on_layer or not torch.allclose(got[on_layer], base[on_layer], atol=1e-2)


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


def test_adapters_come_and_go_on_a_live_model(base, adapters) -> None:
    """Loaded after the model has stepped: its logits are PEFT's; past --max-loras the third
    waits on the host until a residency names it (evicting one, whose host copy gives PEFT's
    logits again when it comes back); unloaded: its slot runs the base and is reused."""
    from transformers import AutoModelForCausalLM

    model = load_model(base, torch.float32, "cpu")
    lora = LoraSlots(model, LoraLimits(max_loras=2, max_rank=16, max_cpu_loras=3))
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompt = _prompt(7)
    runner = PagedRunner(model, num_blocks=128)
    seqs = iter(range(100))

    def logits(slot: int) -> torch.Tensor:
        rows = LoraRows.from_slots([slot] * len(prompt), torch.device("cpu"))
        seq = next(seqs)  # a new sequence each time: the runner continues known ones
        with lora_rows(rows):
            return runner.step({seq: prompt}, all_logits=True)[seq]

    def expect(name: str | None, slot: int | None = None) -> None:
        reference = plain if name is None else adapters[name][1]
        slot = lora.slot_of(name or "") if slot is None else slot
        torch.testing.assert_close(
            logits(slot), reference_logits(reference, prompt), atol=1e-4, rtol=0
        )

    expect(None, 0)
    for name in ADAPTERS:
        lora.load(name, adapters[name][0])
    assert lora.slots == {"attn-r8": 1, "mlp-r16": 2} and list(lora.loaded) == list(ADAPTERS)
    expect("attn-r8")
    with pytest.raises(LoraError, match="'all-rs' is not resident"):
        lora.slot_of("all-rs")
    with pytest.raises(LoraError, match="'extra': 3 of --max-cpu-loras 3 already loaded"):
        lora.read("extra", adapters["all-rs"][0])
    lora.reside(["mlp-r16", "all-rs"])  # attn-r8 evicted: all-rs takes its slot
    assert lora.slots == {"mlp-r16": 2, "all-rs": 1}
    expect("all-rs")
    expect("mlp-r16")
    lora.reside(["all-rs", "attn-r8", "gone"])  # back from its host copy; unknown ids ignored
    assert lora.slots == {"all-rs": 1, "attn-r8": 2}
    expect("attn-r8")
    with pytest.raises(LoraError, match="3 LoRA adapters asked resident, over --max-loras 2"):
        lora.reside(list(ADAPTERS))
    lora.unload("attn-r8")
    expect(None, 2)  # the freed slot runs the base
    lora.unload("mlp-r16")  # not resident: its host copy goes
    assert lora.slots == {"all-rs": 1} and list(lora.loaded) == ["all-rs"]
    lora.load("attn-r8", adapters["attn-r8"][0])
    assert lora.slots == {"all-rs": 1, "attn-r8": 2}
    expect("all-rs")
    lora.unload("all-rs")
    lora.unload("attn-r8")
    assert not [m for m in model.modules() if getattr(m, "lora", None) is not None]
    expect(None, 0)


def test_limits_and_refusals_leave_the_model_as_it_was(base, adapters, tmp_path) -> None:
    import shutil

    model = load_model(base, torch.float32, "cpu")
    lora = LoraSlots(model, LoraLimits(max_loras=4, max_rank=8))
    with pytest.raises(LoraError, match=r"'mlp-r16' has rank 16, over --max-lora-rank 8"):
        lora.load("mlp-r16", adapters["mlp-r16"][0])
    lora.load("attn-r8", adapters["attn-r8"][0])
    with pytest.raises(LoraError, match="'attn-r8' is already loaded"):
        lora.load("attn-r8", adapters["attn-r8"][0])
    # An adapter whose last update does not fit is refused before any layer changes.
    folder = tmp_path / "half"
    shutil.copytree(adapters["attn-r8"][0], folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    last = sorted(k for k in tensors if ".lora_B." in k)[-1]
    tensors[last] = torch.zeros(tensors[last].shape[0] + 1, tensors[last].shape[1])
    save_file(tensors, folder / "adapter_model.safetensors")
    holders = [m for m in model.modules() if getattr(m, "lora", None) is not None]
    before = {id(m): dict(m.lora.updates) for m in holders}
    with pytest.raises(LoraError, match="do not fit the base layer"):
        lora.load("half", folder)
    assert {id(m): dict(m.lora.updates) for m in holders} == before
    with pytest.raises(LoraError, match=r"'nope' is not loaded \(loaded: attn-r8\)"):
        lora.unload("nope")
    refused = LoraSlots(model, unsupported="LoRA adapters need a native implementation")
    with pytest.raises(LoraError, match="need a native implementation"):
        refused.read("attn-r8", adapters["attn-r8"][0])


async def test_the_shard_loads_and_unloads_adapters_over_grpc(tmp_path) -> None:
    """LoadAdapter on a warmed-up shard: the next step's logprobs are PEFT's merged model's;
    its refusals are INVALID_ARGUMENT; after UnloadAdapter a request naming it is refused."""
    import grpc

    from textgate.proto import generate_pb2 as pb
    from textgate.shard_server.loading.shard_loader import load_model as load_shard
    from textgate.shard_server.startup.cache_config import CacheConfig
    from textgate.tests.conftest import build_tiny_model
    from textgate.tests.shard_server.conftest import make_request
    from textgate.tests.shard_server.test_server import served, status_of

    folder = build_tiny_model(tmp_path / "base")
    merged = make_adapter(folder, tmp_path / "mine", 3, r=8, target_modules=["q_proj", "down_proj"])
    make_adapter(folder, tmp_path / "wide", 4, r=16, target_modules=["v_proj"])
    paged = load_shard(
        folder,
        "tiny",
        "float32",
        cache_config=CacheConfig(block_size=4),
        lora_limits=LoraLimits(max_loras=1, max_rank=8, max_cpu_loras=1),
    )
    prompt = [5, 17, 42, 8]

    def step(request_id: int, adapter: str) -> pb.StepRequest:
        request = make_request(request_id, prompt, 1)
        request.adapter_id = adapter
        scheduled = pb.ScheduledRequest(
            request_id=request_id, token_ids=prompt, block_table=[request_id], produces_token=True
        )
        plan = pb.StepPlan(scheduled=[scheduled])
        if adapter:  # the router makes an adapter resident with the first step that needs it
            plan.lora_residency.adapter_ids.append(adapter)
        return pb.StepRequest(requests=[request], plan=plan)

    async with served(paged, tmp_path) as stub:
        await stub.Warmup(pb.WarmupRequest(max_prefill_tokens=16))
        await stub.Step(step(1, ""))
        loaded = await stub.LoadAdapter(
            pb.LoadAdapterRequest(adapter_id="mine", path=str(tmp_path / "mine"))
        )
        assert (loaded.rank, loaded.num_updates) == (8, 2 * 2)  # two projections, two layers
        info = await stub.Info(pb.InfoRequest())
        assert (list(info.lora_adapters), info.max_loras, info.max_lora_rank) == (["mine"], 1, 8)
        assert (list(info.resident_lora_adapters), info.max_cpu_loras) == ([], 1)
        tokens = (await stub.Step(step(2, "mine"))).generations[0].tokens
        info = await stub.Info(pb.InfoRequest())
        assert list(info.resident_lora_adapters) == ["mine"]
        with torch.inference_mode():
            expected = torch.log_softmax(merged(torch.tensor([prompt])).logits[0, -1], -1)
        assert tokens.logprobs[0] == pytest.approx(float(expected[tokens.ids[0]]), abs=1e-4)

        async def refused(name: str, message: str) -> None:
            request = pb.LoadAdapterRequest(adapter_id=name, path=str(tmp_path / name))
            code, details = await status_of(stub.LoadAdapter(request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details

        await refused("mine", "'mine' is already loaded")
        await refused("wide", "1 of --max-cpu-loras 1 already loaded (mine)")
        await stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="mine"))
        answer = (await stub.Step(step(3, "mine"))).generations[0]
        assert "LoRA adapter 'mine' is not loaded (loaded: none)" in answer.error
        await refused("wide", "'wide' has rank 16, over --max-lora-rank 8")
        await refused("gone", "has no adapter_config.json")
        code, details = await status_of(
            stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="mine"))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not loaded" in details


def test_phi3s_fused_targets_give_peft_merged_models_logits(tmp_path) -> None:
    """Phi-3's PEFT adapters name the fused `qkv_proj` and `gate_up_proj`: each B is cut
    into its parts (q/k/v, gate/up) where the native layer's are; mixed in one step with an
    unfused one and the base, each row equals its own model's."""
    from transformers import AutoModelForCausalLM

    base = tmp_path / "phi3"
    build_tiny(base, "phi3", num_key_value_heads=2)  # q and k/v of different widths
    fused = make_adapter(
        base, tmp_path / "fused", 0, r=8, lora_alpha=16,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    )  # fmt: skip
    attention = make_adapter(base, tmp_path / "qkv", 1, r=4, target_modules=["qkv_proj"])
    model = load_model(base, torch.float32, "cpu")
    loaded = [
        LoraAdapter.load(name, tmp_path / name, torch.float32, torch.device("cpu"))
        for name in ("fused", "qkv")
    ]
    slots = attach(model, loaded)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    references = {0: plain, slots["fused"]: fused, slots["qkv"]: attention}
    prompts = {seq: _prompt(5 + seq, seed=seq) for seq in range(3)}
    slot_of = dict(zip(prompts, references, strict=True))
    rows = [slot_of[seq] for seq, prompt in prompts.items() for _ in prompt]
    with lora_rows(LoraRows.from_slots(rows, torch.device("cpu"))):
        logits = PagedRunner(model).step(prompts, all_logits=True)
    for seq, prompt in prompts.items():
        expected = reference_logits(references[slot_of[seq]], prompt)
        torch.testing.assert_close(logits[seq], expected, atol=1e-4, rtol=0, msg=f"seq {seq}")
        if slot_of[seq]:  # the adapter moved the logits, so the split was tested
            assert (expected - reference_logits(plain, prompt)).abs().max() > 1e-2


def test_an_adapter_on_experts_is_refused_and_one_on_attention_serves(tmp_path) -> None:
    """Mixture-of-experts layers take no LoRA: an adapter on Mixtral's experts stops the
    load naming the layer; one on its attention gives PEFT's logits."""
    from safetensors.torch import save_file

    base = tmp_path / "mixtral"
    build_tiny(base, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    model = load_model(base, torch.float32, "cpu")
    slots = LoraSlots(model)
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    key = "base_model.model.model.layers.1.mlp.experts.0.down_proj"
    pair = {f"{key}.lora_A.weight": torch.ones(4, 37), f"{key}.lora_B.weight": torch.ones(32, 4)}
    save_file(pair, experts / "adapter_model.safetensors")
    with pytest.raises(
        LoraError, match="down_proj of layer 1, which has none: its MLP is a mixture"
    ):
        slots.read("experts", experts)
    merged = make_adapter(base, tmp_path / "attn", 0, r=4, target_modules=["q_proj", "o_proj"])
    slots.load("attn", tmp_path / "attn")
    prompt = _prompt(6)
    with lora_rows(LoraRows.from_slots([slots.slot_of("attn")] * 6, torch.device("cpu"))):
        logits = PagedRunner(model).step({0: prompt}, all_logits=True)[0]
    torch.testing.assert_close(logits, reference_logits(merged, prompt), atol=1e-4, rtol=0)
