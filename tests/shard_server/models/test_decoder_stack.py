"""Decoder layers as one C call per step (kernels/cpu_decoder.py), their linears int8
(`--quantize int8`) or dense float32/bfloat16 (the default): the same bytes as the modules,
step for step, and the modules wherever a step or a model does not fit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from textgate.kernels import AttentionMetadata, cpu_build, cpu_isa
from textgate.kernels.cpu_decoder import DecoderStack
from textgate.shard_server.models import load_model
from textgate.tests.conftest import build_tiny_model

pytestmark = pytest.mark.skipif(
    cpu_build.load_library() is None, reason="no C kernels here (no compiler)"
)

BLOCK_SIZE = 4
# (query_lens, context_lens) of three steps over three sequences: two prompts, then decodes
# beside a third prompt, then decodes whose keys span several blocks.
STEPS = [([12, 7], [0, 0]), ([1, 1, 5], [12, 7, 0]), ([1, 1, 1], [13, 8, 5])]
TABLES = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10]]


def _run_steps(
    model, use_stack: bool, steps=STEPS
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of every row of each step, and the caches after the last one."""
    model.use_decoder_stack = use_stack
    cache = model.allocate_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    logits = []
    with torch.inference_mode():
        for query_lens, context_lens in steps:
            tables = TABLES[: len(query_lens)]
            metadata = AttentionMetadata.build(
                query_lens=query_lens,
                context_lens=context_lens,
                block_tables=tables,
                block_size=BLOCK_SIZE,
            )
            total = sum(query_lens)
            tokens = torch.randint(3, model.vocab_size, (total,), generator=generator)
            rows = torch.arange(total)
            logits.append(model(tokens, metadata.positions(), cache, metadata, rows))
    return logits, [*cache.key_caches, *cache.value_caches]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of DecoderStack.run ran the step (True) or declined (False)."""
    outcomes: list[bool] = []
    run = DecoderStack.run

    def spied(self: DecoderStack, *args: object) -> object:
        out = run(self, *args)
        outcomes.append(out is not None)
        return out

    monkeypatch.setattr(DecoderStack, "run", spied)
    return outcomes


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints of the shapes the stack takes: tied llama, Qwen2 (q/k/v bias) and
    Mistral with a sliding window shorter than the sequences."""
    root = tmp_path_factory.mktemp("decoder-stack")
    return {
        "llama": build_tiny_model(root / "llama"),
        "qwen2": build_tiny_model(root / "qwen2", "qwen2"),
        "mistral": build_tiny_model(root / "mistral", "mistral", sliding_window=6),
    }


@pytest.mark.parametrize("quantize", ["int8", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_the_stack_gives_the_modules_bytes(models, name, dtype, quantize, monkeypatch):
    # Float layers on cpu_dense.c even where it leaves them to oneDNN (bf16 on AMX).
    monkeypatch.setenv("TEXTGATE_DENSE_KERNEL", "1")
    model = load_model(models[name], dtype, "cpu", quantize=quantize)
    ran = _spy(monkeypatch)
    stacked, stacked_caches = _run_steps(model, use_stack=True)
    assert isinstance(model.decoder_stack, DecoderStack)
    assert ran == [True] * len(STEPS)
    modules, module_caches = _run_steps(model, use_stack=False)
    assert len(ran) == len(STEPS)  # the modules' run did not call it
    for got, expected in zip(stacked, modules, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(stacked_caches, module_caches, strict=True):
        assert torch.equal(got, expected)


def test_steps_and_models_that_do_not_fit_run_the_modules(models, tmp_path, monkeypatch):
    model = load_model(models["llama"], torch.float32, "cpu", quantize="int8")
    outcomes = _spy(monkeypatch)
    # A prompt chunk over more keys than the CPU kernel takes goes to SDPA: the modules run.
    long_prompt = [([120], [0])]
    TABLES[0], saved = list(range(1, 31)), TABLES[0]
    try:
        stacked, _ = _run_steps(model, use_stack=True, steps=long_prompt)
        modules, _ = _run_steps(model, use_stack=False, steps=long_prompt)
    finally:
        TABLES[0] = saved
    assert torch.equal(stacked[0], modules[0])
    assert outcomes == []  # the model saw the SDPA plan and did not ask the stack

    # A quantized KV cache: the stack declines, the modules run.
    model.set_kv_cache_dtype(torch.int8)
    _run_steps(model, use_stack=True, steps=STEPS[:1])
    assert outcomes == [False]

    # Dense layers left on oneDNN (TEXTGATE_DENSE_KERNEL=0) and layers it does not reproduce
    # (Qwen3's q/k norms) build none.
    monkeypatch.setenv("TEXTGATE_DENSE_KERNEL", "0")
    on_onednn = load_model(models["llama"], torch.float32, "cpu")
    _run_steps(on_onednn, use_stack=True, steps=STEPS[:1])
    assert on_onednn.decoder_stack is None
    monkeypatch.delenv("TEXTGATE_DENSE_KERNEL")
    qwen3 = load_model(build_tiny_model(tmp_path / "qwen3", "qwen3", head_dim=16), torch.float32,
                       "cpu", quantize="int8")  # fmt: skip
    _run_steps(qwen3, use_stack=True, steps=STEPS[:1])
    assert qwen3.decoder_stack is None


_LEVEL_CHECK = """
import torch
from textgate.tests.shard_server.models.test_decoder_stack import _run_steps
from textgate.kernels import cpu_build
from textgate.kernels import dense_linear as dense
from textgate.kernels.int8_linear import default_kernel
from textgate.shard_server.models import load_model
assert cpu_build.loaded_level() == {level!r}, cpu_build.loaded_level()
for dtype, quantize in ((torch.float32, "int8"), (torch.float32, None), (torch.bfloat16, None)):
    model = load_model({model!r}, dtype, "cpu", quantize=quantize)
    stacked, _ = _run_steps(model, use_stack=True)
    # Where oneDNN sums int8 exactly it serves the portable level (int8_linear.default_kernel),
    # and float layers there stay on oneDNN (dense_linear.serves): then no stack is built.
    on_c = dense.serves(dtype) if quantize is None else default_kernel(torch.device("cpu")) == "cpu"
    assert (model.decoder_stack is not None) == on_c, (dtype, quantize)
    modules, _ = _run_steps(model, use_stack=False)
    assert all(torch.equal(a, b) for a, b in zip(stacked, modules)), (dtype, quantize)
"""


@pytest.mark.parametrize(
    "level", [level.name for level in cpu_isa.runnable_levels()[:-1]] or ["none below"]
)
def test_every_instruction_set_level_gives_the_modules_bytes(models, level):
    """The levels below this CPU's best (AVX2, portable C) are what other CI machines run."""
    if level == "none below":
        pytest.skip("this CPU runs one level only")
    script = _LEVEL_CHECK.format(level=level, model=str(models["llama"]))
    env = {**os.environ, "TEXTGATE_CPU_ISA": level}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
