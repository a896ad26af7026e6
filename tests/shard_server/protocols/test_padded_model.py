"""The padded protocol's batch cache (PaddedModel), over the transformers fallback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.protocols.shard_model import BatchNotFound, InvalidCall, UnsupportedCall
from textgate.shard_server.protocols.transformers_model import TransformersModel

PROMPTS = [[5, 17, 42, 8], [9, 3], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> TransformersModel:
    return TransformersModel(tiny_model_dir, torch.float32, torch.device("cpu"), "tiny")


def test_the_padded_protocol_caches_batches_by_id_and_refuses_step(
    model: TransformersModel,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    first = model.prefill(batch_factory(40, request_factory(1, PROMPTS[0], 5)))
    second = model.prefill(batch_factory(41, request_factory(2, PROMPTS[1], 5)))
    assert set(model.batches) == {40, 41}
    merged = model.decode([first.batch, second.batch])
    assert list(merged.batch.request_ids) == [1, 2] and set(model.batches) == {40}
    assert list(model.filter(40, [2]).request_ids) == [2]
    assert model.filter(40, []) == pb.CachedBatch(id=40) and not model.batches
    with pytest.raises(BatchNotFound, match="batch 40 not found"):
        model.decode([merged.batch])
    with pytest.raises(InvalidCall, match="at least one"):
        model.prefill(pb.Batch(id=42))
    model.prefill(batch_factory(43, request_factory(3, PROMPTS[2], 5)))
    model.clear(None)
    assert not model.batches
    with pytest.raises(UnsupportedCall, match="this shard is padded"):
        model.step([], pb.StepPlan())
