"""Startup measurements: the probe's geometry, and a tiny model's warmup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server import autoconfig, loader
from textgate.shard_server.autoconfig import ProbePlan, StepTimings
from textgate.shard_server.loader import load_model
from textgate.shard_server.paged_model import CacheConfig, PagedModel

SMALL_CACHE = CacheConfig(block_size=16, kv_cache_memory=8 << 20)


def timings(decode: dict[int, float], prefill_ms: float, tokens: int = 128) -> StepTimings:
    return StepTimings(decode_ms=decode, prefill_tokens=tokens, prefill_ms=prefill_ms)


# -- what is measured ------------------------------------------------------------------------


def test_decode_batch_sizes_go_up_to_the_max_batch_within_the_cache() -> None:
    assert autoconfig.decode_batch_sizes(0, 1000) == [1, 8, 32]
    assert autoconfig.decode_batch_sizes(4, 1000) == [1, 4]
    assert autoconfig.decode_batch_sizes(64, 1000) == [1, 8, 32, 64]
    assert autoconfig.decode_batch_sizes(0, 20) == [1, 8, 20]
    assert autoconfig.decode_batch_sizes(4096, 10_000) == [1, 8, 32, 256]
    with pytest.raises(ValueError, match="cannot hold"):
        autoconfig.decode_batch_sizes(0, 0)


def test_the_probe_fits_the_cache_and_the_model_positions() -> None:
    plan = ProbePlan.fit([1, 8, 32], 512, num_blocks=100, block_size=16, max_positions=4096)
    # 128 + 3 tokens take 9 blocks: 11 sequences fit, not 32.
    assert plan == ProbePlan(batch_sizes=(1, 8), context=128, prefill_tokens=512)
    assert plan.num_blocks(16) == 72
    short = ProbePlan.fit([1], 512, num_blocks=100, block_size=16, max_positions=64)
    assert (short.context, short.prefill_tokens) == (60, 63)
    with pytest.raises(ValueError, match="cannot hold"):
        ProbePlan.fit([1], 64, num_blocks=5, block_size=16, max_positions=4096)


# -- a tiny model ----------------------------------------------------------------------------


def load(path: Path, dtype: str) -> PagedModel:
    model = load_model(path, "tiny", dtype, cache_config=SMALL_CACHE)
    assert isinstance(model, PagedModel)
    return model


def test_warmup_measures_the_step_and_reports_an_explicit_dtype(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_trials(*args: Any) -> None:
        raise AssertionError("an explicit dtype measures no other dtype")

    monkeypatch.setattr(loader, "pick_dtype", no_trials)
    model = load(tiny_model_dir, "bfloat16")
    warm = model.warmup(pb.WarmupRequest(max_prefill_tokens=48, max_batch_size=0))
    assert [t.batch_size for t in warm.decode_timings] == [1, 8, 32]
    assert all(0 < t.step_ms < 10_000 for t in warm.decode_timings)
    assert warm.prefill_chunk_tokens == 48 and warm.prefill_tokens_per_s > 0
    assert 0 < warm.measure_ms < 60_000 and warm.num_threads == torch.get_num_threads()
    assert warm.device_name
    assert (warm.dtype, warm.dtype_source, len(warm.dtype_trials)) == ("bfloat16", "flag", 0)
    assert warm.num_blocks > 0 and not model.sequences  # the probe's sequences are gone
    smaller = model.warmup(pb.WarmupRequest(max_prefill_tokens=16, max_batch_size=4))
    assert [t.batch_size for t in smaller.decode_timings] == [1, 4]
