"""The native Llama model on the Triton path (attention backend and fused layer ops) gives
the torch backend's logits, on a tiny random config, over prefill, prefix-cached chunks,
decodes and mixed steps, with a float or an int8 KV cache. On CPU tensors in triton's
interpreter, or on CUDA (`-m gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from textgate.kernels import AttentionMetadata, cpu_build
from textgate.kernels.triton import layers
from textgate.shard_server.models import load_model

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head dim 16, GQA 2: 4 query heads over 2 kv heads, 2 layers, random weights."""
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,  # larger weights make attention matter
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


class Runner:
    """Sequences over scattered cache blocks, as a shard keeps them."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device
        self.cache = model.allocate_kv_cache(16, BLOCK_SIZE)
        self.free = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Feed each sequence its new tokens: every new token's logits [T, V] (float32, CPU)."""
        for seq, tokens in chunks.items():
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * BLOCK_SIZE < self.lengths.get(seq, 0) + len(tokens):
                blocks.append(self.free.pop())
        metadata = AttentionMetadata.build(
            query_lens=[len(tokens) for tokens in chunks.values()],
            context_lens=[self.lengths.get(seq, 0) for seq in chunks],
            block_tables=[self.blocks[seq] for seq in chunks],
            block_size=BLOCK_SIZE,
            device=self.device,
        )
        input_ids = torch.tensor([t for tokens in chunks.values() for t in tokens])
        rows = torch.arange(len(input_ids), device=self.device)
        for seq, tokens in chunks.items():
            self.lengths[seq] = self.lengths.get(seq, 0) + len(tokens)
        with torch.inference_mode():
            logits = self.model(
                input_ids.to(self.device), metadata.positions(), self.cache, metadata, rows
            )
        return logits.cpu()


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# A prompt over two blocks and a short one; a prefix-cached chunk beside two decodes; decodes.
STEPS = [
    {0: tokens(21, 1), 1: tokens(5, 2)},
    {0: [3], 1: tokens(9, 3), 2: tokens(4, 4)},
    {0: [7], 1: [11], 2: [13]},
    {0: [17], 1: [19], 2: [23]},
]


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8)],
)
def test_logits_match_the_torch_backend(checkpoint, triton_device, monkeypatch, dtype, kv_dtype):
    monkeypatch.setattr(cpu_build, "load_library", lambda: None)  # no C kernels on either side
    fused_norms = 0
    fused = layers.add_rms_norm

    def counting(*args):
        nonlocal fused_norms
        out = fused(*args)
        fused_norms += out is not None
        return out

    def run(dtype: torch.dtype, backend: str, devices: tuple[str, ...]) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "enabled_devices", devices)
        model = load_model(checkpoint, dtype, triton_device, attention_backend=backend)
        if kv_dtype is not None:  # both sides read the same quantized cache
            model.set_kv_cache_dtype(kv_dtype)
        runner = Runner(model, triton_device)
        return [runner.step(step) for step in STEPS]

    monkeypatch.setattr(layers, "add_rms_norm", counting)
    triton = run(dtype, "triton", ("cuda", "cpu"))  # the fused ops too
    assert fused_norms == 5 * len(STEPS)  # 2 layers x 2 norms + the final one, per step
    exact = run(torch.float32, "torch", ())  # the PyTorch references
    if dtype == torch.float32:
        for actual, expected in zip(triton, exact, strict=True):
            torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
        return
    # bfloat16 rounds differently on each path (the interpreter even truncates where a GPU
    # rounds to nearest): over the steps, the Triton path may stray from float32 by at
    # most 1.5x what the torch path does in the same dtype (~0.14 here; a wrong kernel: ~1).
    rounded = run(dtype, "torch", ())

    def worst(outputs: list[torch.Tensor]) -> float:
        return max(float((out - ref).abs().max()) for out, ref in zip(outputs, exact, strict=True))

    assert worst(triton) <= 1.5 * worst(rounded) + 0.02
