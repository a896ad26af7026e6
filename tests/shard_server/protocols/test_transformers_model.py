"""The transformers fallback: greedy equals a no-cache reference; join/leave changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.protocols.transformers_model import TransformersModel

PROMPTS = [
    [5, 17, 42, 8],
    [9, 3],
    [11, 12, 13, 14, 15, 16, 17, 18, 19],
    [100, 7, 250, 31, 2, 64],
]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> TransformersModel:
    return TransformersModel(tiny_model_dir, torch.float32, torch.device("cpu"), "tiny")


def reference_greedy(model: TransformersModel, ids: list[int], steps: int) -> list[int]:
    """Full recompute every step, no cache, no padding."""
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model.model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[-steps:]


def collect(outputs: dict[int, list[int]], generations: Any) -> None:
    for g in generations:
        outputs.setdefault(g.request_id, []).extend(g.tokens.ids)


def test_prefill_and_decode_match_the_reference(
    model: TransformersModel,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    make_request, make_batch = request_factory, batch_factory
    request = make_request(1, PROMPTS[0], 6)
    outputs: dict[int, list[int]] = {}
    step = model.generate_token(model.batch_from_pb(make_batch(1, request)))
    collect(outputs, step.generations)
    while step.batch is not None:
        step = model.generate_token(step.batch)
        collect(outputs, step.generations)
    assert outputs[1] == reference_greedy(model, PROMPTS[0], 6)
    assert step.generations[0].generated_text.generated_tokens == 6


def test_requests_join_and_leave_a_running_batch(
    model: TransformersModel,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    make_request, make_batch = request_factory, batch_factory
    lengths = [7, 3, 5, 4]
    requests = [
        make_request(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
    ]
    outputs: dict[int, list[int]] = {}
    first = model.generate_token(model.batch_from_pb(make_batch(10, *requests[:2])))
    collect(outputs, first.generations)
    assert first.batch is not None
    running = model.generate_token(first.batch)
    collect(outputs, running.generations)
    # Two more requests join after one decode step: prefill them, then merge.
    joining = model.generate_token(model.batch_from_pb(make_batch(11, *requests[2:])))
    collect(outputs, joining.generations)
    assert running.batch is not None and joining.batch is not None
    batch = model.concatenate([running.batch, joining.batch])
    assert batch.batch_id == 10 and batch.size == 4
    sizes = []
    while batch is not None:
        sizes.append(batch.size)
        step = model.generate_token(batch)
        collect(outputs, step.generations)
        batch = step.batch
    assert sizes[0] == 4 and sizes[-1] == 1, "finished requests must leave the batch"
    for request, n in zip(requests, lengths, strict=True):
        assert outputs[request.id] == reference_greedy(model, list(request.input_ids), n)


def test_filter_drops_cancelled_requests(
    model: TransformersModel,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    make_request, make_batch = request_factory, batch_factory
    requests = [make_request(i, p, 5) for i, p in enumerate(PROMPTS)]
    step = model.generate_token(model.batch_from_pb(make_batch(3, *requests)))
    assert step.batch is not None
    kept = step.batch.filter([2])
    assert kept is not None and [s.id for s in kept.sequences] == [2]
    outputs: dict[int, list[int]] = {2: list(step.generations[2].tokens.ids)}
    batch: Any = kept
    while batch is not None:
        result = model.generate_token(batch)
        collect(outputs, result.generations)
        batch = result.batch
    assert outputs[2] == reference_greedy(model, PROMPTS[2], 5)
    assert step.batch.filter([]) is None


def test_prefill_logprobs_and_top_tokens(
    model: TransformersModel,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    make_request, make_batch = request_factory, batch_factory
    request = make_request(4, PROMPTS[2], 1)
    request.prefill_logprobs = True
    request.top_n_tokens = 3
    short = make_request(5, PROMPTS[1], 1)
    step = model.generate_token(model.batch_from_pb(make_batch(4, request, short)))
    prefill = step.generations[0].prefill_tokens
    assert list(prefill.ids) == PROMPTS[2]
    assert torch.isnan(torch.tensor(prefill.logprobs[0]))
    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([PROMPTS[2]])).logits[0].log_softmax(-1)
    expected = [logits[i, t].item() for i, t in enumerate(PROMPTS[2][1:])]
    assert list(prefill.logprobs[1:]) == pytest.approx(expected, abs=1e-4)
    top = step.generations[0].top_tokens[0]
    assert len(top.ids) == 3 and top.ids[0] == step.generations[0].tokens.ids[0]
    assert not step.generations[1].HasField("prefill_tokens")
    assert step.batch is None


def test_min_new_tokens_and_eos(
    model: TransformersModel,
    request_factory: Callable[..., pb.Request],
    batch_factory: Callable[..., pb.Batch],
) -> None:
    make_request, make_batch = request_factory, batch_factory
    eos = next(iter(model.info.eos_token_ids))
    request = make_request(6, PROMPTS[0], 4, ignore_eos=False)
    request.stopping_parameters.min_new_tokens = 4
    step = model.generate_token(model.batch_from_pb(make_batch(6, request)))
    tokens = list(step.generations[0].tokens.ids)
    while step.batch is not None:
        step = model.generate_token(step.batch)
        tokens += step.generations[0].tokens.ids
    assert eos not in tokens and len(tokens) == 4
