"""Tensor parallel over gloo: two ranks give the same logits as one."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from textgate.kernels import AttentionMetadata
from textgate.shard_server.models import load_model

WORLD_SIZE = 2

# Heads, kv heads, intermediate and vocab sizes that split evenly, unevenly (SmolLM2's
# 9 heads / 3 kv heads do not divide by 2), and fewer kv heads than ranks (replicated).
CASES = {
    "even": ("llama", {}),
    "uneven": (
        "llama",
        {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 37},
    ),
    "mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {"vocab_size": 100}),
}


def _steps() -> list[AttentionMetadata]:
    """A prefill of two sequences, then a mixed step: one decodes, one prefills on a prefix."""
    first = AttentionMetadata.build(
        query_lens=[6, 9], context_lens=[0, 0], block_tables=[[3, 0], [5, 1, 7]], block_size=4
    )
    second = AttentionMetadata.build(
        query_lens=[1, 3], context_lens=[6, 9], block_tables=[[3, 0], [5, 1, 7]], block_size=4
    )
    return [first, second]


def run_steps(path: Path, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """All-row logits of each step of `_steps` for the model in `path`."""
    model = load_model(path, torch.float32, "cpu", group)
    cache = model.allocate_kv_cache(num_blocks=8, block_size=4)
    ids = torch.randint(0, 100, (15 + 4,), generator=torch.Generator().manual_seed(0))
    outputs, offset = [], 0
    with torch.inference_mode():
        for metadata in _steps():
            step_ids = ids[offset : offset + metadata.num_tokens]
            offset += metadata.num_tokens
            rows = torch.arange(metadata.num_tokens)
            outputs.append(model(step_ids, metadata.positions(), cache, metadata, rows))
    return outputs


def _worker(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        for path in paths:
            torch.save(run_steps(path, dist.group.WORLD), out_dir / f"{path.name}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tensor_parallel_matches_single_rank(tiny, tmp_path):
    paths = []
    for name, (kind, overrides) in CASES.items():
        path, _ = tiny(kind, **overrides)
        paths.append(path.rename(path.with_name(name)))
    mp.spawn(_worker, args=(_free_port(), paths, tmp_path), nprocs=WORLD_SIZE, join=True)
    for path in paths:
        expected = run_steps(path, None)
        for rank in range(WORLD_SIZE):
            got = torch.load(tmp_path / f"{path.name}-{rank}.pt")
            for step, (logits, reference) in enumerate(zip(got, expected, strict=True)):
                torch.testing.assert_close(
                    logits, reference, atol=1e-4, rtol=0, msg=f"{path.name} rank {rank} step {step}"
                )
