"""Shared fixtures: tiny random models for unit/shard tests, the live server for e2e tests."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

# The Triton kernels' tests run on CUDA where there is a GPU, else on CPU tensors through
# triton's interpreter, which must be chosen before any `@triton.jit` program is defined:
# here, the root conftest, so that no test module collected earlier (tests/shard_server
# runs the model through the Triton layers too) defines them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
    "café naïve 東京 🙂 — unicode survives byte-level tokenization.",
]


def build_tiny_model(
    path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """A seeded random causal LM with its own small byte-level BPE tokenizer, saved to
    `path`; `overrides` add to (or replace) its config's keys."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    settings: dict[str, Any] = {
        "vocab_size": len(fast),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "tie_word_embeddings": True,
    }
    config = AutoConfig.for_model(model_type, **{**settings, **overrides})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a CUDA device: skipped where there is none."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module, torch and transformers imported: out of the cyclic collector, as
    the servers' startup heap is (`textgate.heap.freeze_startup_heap`). Else each full
    collection of this process walks them all again: up to 912 ms apiece by the end of
    tests/router and tests/shard_server, longer than the deadline tests' bounds."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def frozen_heap() -> None:
    """What the tests so far left alive frozen too (`pytest_collection_finish`), for a test
    that times deadlines: the full collection the heap's growth since would bring stays
    short. It stays frozen after the test (unfreezing would thaw the imports' too)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE: per-head q/k norms, eight experts of which each token runs two."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-moe"),
        "qwen3_moe",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model as a safetensors folder (converted once into the cache)."""
    from textgate.shard_server.loading.model_source import resolve_model

    return resolve_model(None)


class LiveServer:
    """A launcher process serving the embedded default model on a free port."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        from textgate.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "launcher.log"
        argv = [sys.executable, "-m", "textgate.launcher", "--hostname", "127.0.0.1"]
        argv += ["--port", str(self.port), "--shard-uds-path", str(tmp / "shard"), *extra]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"launcher exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def launch_server() -> type[LiveServer]:
    """The LiveServer class, for tests that start launchers with their own flags."""
    return LiveServer


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[str]:
    """Base URL of a launcher serving the embedded default model (shared by all e2e tests)."""
    # float32: `--dtype auto` picks whichever dtype times faster at startup, and in bf16 the
    # default model's greedy answers flip (top-2 logits within one bf16 step), so tests that
    # check exact text or tool choices would depend on a timing race.
    server = LiveServer(
        tmp_path_factory.mktemp("live"), "--max-concurrent-requests", "16", "--dtype", "float32"
    )
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()
