"""Decode graphs on CPU: the runner with an eager stand-in for capture pads, replays and slices
exactly as on a GPU, so its logits must equal the eager forward's for every batch shape."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.step.cuda_graphs import DecodeGraphRunner, EagerGraph, eager_capture

BLOCK = 4
SIZES = (1, 2, 4)
# 96 blocks of the tiny model (2 layers x K,V x 4 slots x 2 kv heads x 16 dims x 4 bytes):
# 95 for sequences, the last one the graphs' scratch block.
KV_MEMORY = 96 * 2 * 2 * BLOCK * 2 * 16 * 4


def paged_model(model_dir: Path, sizes: tuple[int, ...], capture: bool) -> PagedModel:
    config = CacheConfig(block_size=BLOCK, kv_cache_memory=KV_MEMORY, cuda_graphs=sizes)
    model = load_model(model_dir, "tiny", "float32", cache_config=config)
    assert isinstance(model, PagedModel)
    if capture:
        model.graph_capture = eager_capture
    model.warmup(pb.WarmupRequest(max_prefill_tokens=32, max_total_tokens=48, max_batch_size=4))
    return model


@pytest.fixture(scope="module")
def graphed(tiny_model_dir: Path) -> PagedModel:
    return paged_model(tiny_model_dir, SIZES, capture=True)


@pytest.fixture(scope="module")
def eager(tiny_model_dir: Path) -> PagedModel:
    """Sizes set but no capture injected: on CPU that means no graphs (the default)."""
    return paged_model(tiny_model_dir, SIZES, capture=False)


PROMPTS = {1: [5, 17, 42, 8, 9, 10, 11], 2: [9, 3], 3: [11, 12, 13, 14, 15, 16], 4: [7] * 13}


def tables(first_block: int) -> dict[int, list[int]]:
    """12 blocks (48 tokens) per request, consecutive from `first_block`."""
    return {
        rid: list(range(first_block + 12 * i, first_block + 12 * (i + 1)))
        for i, rid in enumerate(PROMPTS)
    }


def prefill(
    model: PagedModel, ids: list[int], table: dict[int, list[int]], make: Callable[..., pb.Request]
) -> dict[int, list[int]]:
    """Admit and prefill `ids`; their tokens so far (prompt + the first sampled one)."""
    requests = [make(rid, PROMPTS[rid], 20) for rid in ids]
    scheduled = [
        pb.ScheduledRequest(
            request_id=rid, token_ids=PROMPTS[rid], block_table=table[rid], produces_token=True
        )
        for rid in ids
    ]
    out = model.step(requests, pb.StepPlan(scheduled=scheduled))
    return {g.request_id: [*PROMPTS[g.request_id], *g.tokens.ids] for g in out.generations}


def decode_plan(tokens: dict[int, list[int]], table: dict[int, list[int]]) -> pb.StepPlan:
    return pb.StepPlan(
        scheduled=[
            pb.ScheduledRequest(
                request_id=rid,
                token_ids=[ids[-1]],
                start_position=len(ids) - 1,
                block_table=table[rid],
                produces_token=True,
            )
            for rid, ids in tokens.items()
        ]
    )


def mixed_plan(
    tokens: dict[int, list[int]], table: dict[int, list[int]], new_id: int
) -> pb.StepPlan:
    """Decode `tokens`' sequences and prefill request `new_id` in one step."""
    plan = decode_plan(tokens, table)
    plan.scheduled.append(
        pb.ScheduledRequest(
            request_id=new_id,
            token_ids=PROMPTS[new_id],
            block_table=table[new_id],
            produces_token=True,
        )
    )
    return plan


@pytest.mark.parametrize("ids", [[2], [1, 3], [1, 2, 4], [1, 2, 3, 4]])
def test_padded_replay_logits_equal_eager_logits_for_ragged_batches(
    graphed: PagedModel, ids: list[int], request_factory: Callable[..., pb.Request]
) -> None:
    table = tables(first_block=0)
    tokens = prefill(graphed, ids, table, request_factory)
    inputs = graphed._inputs(decode_plan(tokens, table).scheduled)
    runner = graphed.graphs
    assert runner is not None and graphed.kv_cache is not None
    bucket = runner.bucket_for(len(ids))
    assert bucket is not None
    graph = runner.buckets[bucket].graph
    assert isinstance(graph, EagerGraph)
    replays = graph.replays
    with torch.inference_mode():
        replayed = runner.run(
            inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices
        )
        assert replayed is not None
        replayed = replayed.clone()
        reference = graphed.model(
            inputs.input_ids,
            inputs.positions,
            graphed.kv_cache,
            inputs.metadata,
            inputs.logits_indices,
        )
    assert graph.replays == replays + 1
    assert replayed.shape == reference.shape == (len(ids), reference.shape[1])
    torch.testing.assert_close(replayed, reference, rtol=1e-5, atol=1e-5)
    graphed.step([], pb.StepPlan(finished_ids=ids))


def test_generation_through_graphs_equals_eager_and_buffers_are_reused(
    graphed: PagedModel, eager: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    runner = graphed.graphs
    assert runner is not None
    buffers = [runner.input_ids, runner.seq_lens, runner.block_tables, runner.slot_mapping]
    pointers = [b.data_ptr() for b in buffers]
    buckets = dict(runner.buckets)
    replays = {size: b.graph.replays for size, b in buckets.items()}  # type: ignore[attr-defined]
    outputs: dict[str, dict[int, list[int]]] = {}
    for name, model in (("graphed", graphed), ("eager", eager)):
        table = tables(first_block=0)
        tokens = prefill(model, [1, 2, 3], table, request_factory)
        for step in range(10):
            new, plan = [], decode_plan(tokens, table)
            if step == 4:  # request 4 joins: a mixed step (prefill + decode) runs eager
                new, plan = [request_factory(4, PROMPTS[4], 20)], mixed_plan(tokens, table, 4)
                tokens[4] = list(PROMPTS[4])
            if step == 7:  # 3 is done: a batch of 3 again, padded to 4
                plan = decode_plan({k: v for k, v in tokens.items() if k != 3}, table)
                plan.finished_ids.append(3)
                del tokens[3]
            out = model.step(new, plan)
            for g in out.generations:
                tokens[g.request_id].extend(g.tokens.ids)
        model.step([], pb.StepPlan(finished_ids=list(tokens)))
        outputs[name] = tokens
    assert outputs["graphed"] == outputs["eager"]
    assert [b.data_ptr() for b in buffers] == pointers
    assert runner.buckets == buckets  # nothing recaptured
    # Steps 0-3 (3 sequences) and 7-9 (3) pad to 4, 5-6 fill it; step 4 (mixed) ran eager.
    assert buckets[4].graph.replays - replays[4] == 9  # type: ignore[attr-defined]
    assert buckets[1].graph.replays == replays[1]  # type: ignore[attr-defined]


def test_padding_rows_write_only_the_scratch_block(
    graphed: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    runner, cache = graphed.graphs, graphed.kv_cache
    assert runner is not None and cache is not None
    table = tables(first_block=40)
    tokens = prefill(graphed, [1, 3, 4], table, request_factory)  # bucket 4: one padding row
    for key_cache in cache.key_caches:  # earlier padding rows wrote the same keys there
        key_cache[runner.scratch_block].fill_(7.0)
    before = [k.clone() for k in cache.key_caches]
    graphed.step([], decode_plan(tokens, table))
    written = {  # the slot each decoded token was stored in
        table[rid][(len(ids) - 1) // BLOCK] * BLOCK + (len(ids) - 1) % BLOCK
        for rid, ids in tokens.items()
    }
    for layer, (old, new) in enumerate(zip(before, cache.key_caches, strict=True)):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) - written == {runner.scratch_slot}, layer
    graphed.step([], pb.StepPlan(finished_ids=list(tokens)))


def test_steps_graphs_cannot_take_run_eager(
    graphed: PagedModel, request_factory: Callable[..., pb.Request]
) -> None:
    runner = graphed.graphs
    assert runner is not None
    table = tables(first_block=0)
    tokens = prefill(graphed, [1, 2, 3, 4], table, request_factory)
    inputs = graphed._inputs(decode_plan(tokens, table).scheduled)
    assert runner.bucket_for(4) == 4 and runner.bucket_for(5) is None
    metadata = inputs.metadata
    # Fewer logits rows than sequences (a prompt chunk that samples nothing).
    assert (
        runner.run(inputs.input_ids, inputs.positions, metadata, inputs.logits_indices[:3]) is None
    )
    wide = type(metadata)(
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
        block_tables=torch.zeros(4, runner.max_blocks_per_seq + 1, dtype=torch.int64),
        slot_mapping=metadata.slot_mapping,
        max_seqlen_q=1,
        max_seqlen_k=metadata.max_seqlen_k,
    )
    assert runner.run(inputs.input_ids, inputs.positions, wide, inputs.logits_indices) is None
    graphed.step([], pb.StepPlan(finished_ids=[1, 2, 3, 4]))


def test_cuda_graphs_are_ignored_on_cpu_with_a_log_line(
    eager: PagedModel, caplog: pytest.LogCaptureFixture
) -> None:
    assert eager.graphs is None
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        assert eager._graph_capture() is None
    assert "--cuda-graphs ignored" in caplog.text
    # No scratch block is kept: the router gets every block.
    assert eager.kv_cache is not None and eager.kv_cache.num_blocks == eager.num_blocks()


def test_runner_rejects_bad_settings(graphed: PagedModel) -> None:
    cache = graphed.kv_cache
    assert cache is not None
    with pytest.raises(ValueError, match="must be positive"):
        DecodeGraphRunner(
            graphed.model,
            cache,
            [0, 2],
            max_blocks_per_seq=4,
            scratch_block=0,
            capture=eager_capture,
        )
    with pytest.raises(ValueError, match="not in the cache"):
        DecodeGraphRunner(
            graphed.model,
            cache,
            [1],
            max_blocks_per_seq=4,
            scratch_block=cache.num_blocks,
            capture=eager_capture,
        )
    with pytest.raises(ValueError, match="cuda_graphs sizes must be positive"):
        CacheConfig(cuda_graphs=(1, 0))


def test_cuda_graphs_flag_reaches_the_shard_like_tgi(tiny_model_dir: Path) -> None:
    import argparse

    from textgate import launcher
    from textgate.shard_server.__main__ import parse_args as shard_args

    assert launcher.parse_args([], env={}).cuda_graphs == (1, 2, 4, 8, 16, 32)
    assert launcher.parse_args(["--cuda-graphs", "8,1,2,2"], env={}).cuda_graphs == (1, 2, 8)
    assert launcher.parse_args([], env={"CUDA_GRAPHS": "0"}).cuda_graphs == ()
    for bad in ("1,x", "0,4", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            launcher.cuda_graph_sizes(bad)
    for flag, sizes in (("0", ()), ("4,16", (4, 16))):
        argv = launcher.shard_argv(
            tiny_model_dir, launcher.parse_args(["--cuda-graphs", flag], env={})
        )
        shard = shard_args(argv[argv.index("--model-path") :])
        assert shard.cuda_graphs == sizes


@pytest.mark.gpu
def test_real_cuda_graphs_replay_the_eager_logits_on_a_gpu(
    tiny_model_dir: Path, request_factory: Callable[..., pb.Request]
) -> None:
    """The whole GPU path: the cache sized from a measured pass, graphs captured with
    torch.cuda.CUDAGraph (triton attention), padded replays equal to eager steps."""
    config = CacheConfig(block_size=16, cuda_memory_fraction=0.01, cuda_graphs=SIZES)
    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=config, attention="triton")
    assert isinstance(model, PagedModel) and model.device.type == "cuda"
    warm = model.warmup(
        pb.WarmupRequest(max_prefill_tokens=64, max_total_tokens=12 * 16, max_batch_size=4)
    )
    runner, cache = model.graphs, model.kv_cache
    assert runner is not None and cache is not None
    assert cache.num_blocks == warm.num_blocks + 1  # the scratch block
    assert all(isinstance(b.graph, torch.cuda.CUDAGraph) for b in runner.buckets.values())
    table = tables(first_block=0)
    for ids in ([2], [1, 3], [1, 2, 4]):
        tokens = prefill(model, ids, table, request_factory)
        inputs = model._inputs(decode_plan(tokens, table).scheduled)
        with torch.inference_mode():
            replayed = runner.run(
                inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices
            )
            assert replayed is not None
            replayed = replayed.clone()
            eager = model.model(
                inputs.input_ids, inputs.positions, cache, inputs.metadata, inputs.logits_indices
            )
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        model.step([], pb.StepPlan(finished_ids=ids))
