"""Prometheus metrics: TGI's names and buckets, and that they move with the traffic."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.generation.result import collect
from textgate.router.metrics import (
    DURATION_BUCKETS,
    Metrics,
    RequestTimings,
)
from textgate.router.metrics_collectors import KvCacheStats, KvTierStats
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard

StartRouter = Callable[..., Awaitable[str]]

TGI_NAMES = [
    "tgi_request_count",
    "tgi_request_success",
    "tgi_request_failure",
    "tgi_request_duration",
    "tgi_request_validation_duration",
    "tgi_request_queue_duration",
    "tgi_request_inference_duration",
    "tgi_request_mean_time_per_token_duration",
    "tgi_request_generated_tokens",
    "tgi_request_input_length",
    "tgi_request_max_new_tokens",
    "tgi_queue_size",
    "tgi_batch_current_size",
    "tgi_batch_current_max_tokens",
    "tgi_batch_next_size",
    "tgi_batch_inference_duration",
    "tgi_batch_inference_count",
    "tgi_batch_inference_success",
    "tgi_batch_forward_duration",
    "tgi_batch_decode_duration",
    "tgi_batch_filter_duration",
]


def samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def test_counters_keep_tgis_bare_names() -> None:
    metrics = Metrics()
    metrics.request_received()
    metrics.request_failed("incomplete_generation")
    text = metrics.render().decode()
    assert types(text)["tgi_request_count"] == "counter"
    values = samples(text)
    assert values["tgi_request_count"] == 1
    assert values['tgi_request_failure{err="incomplete"}'] == 1
    assert not [name for name in values if name.endswith("_total") or "_created" in name]


def test_histograms_use_tgis_buckets() -> None:
    metrics = Metrics(max_input_tokens=1000, max_total_tokens=2000)
    metrics.request_validated(input_length=15, max_new_tokens=20)
    metrics.request_succeeded(RequestTimings(0.0, 0.1, 0.2, 1.2, generated_tokens=4))
    values = samples(metrics.render().decode())
    # Durations: 35 geometric buckets from 0.15 ms (TGI: 0.0001 * 1.5^k).
    assert len(DURATION_BUCKETS) == 35
    assert DURATION_BUCKETS[0] == 0.0001 * 1.5
    assert values["tgi_request_mean_time_per_token_duration_sum"] == 0.25
    # Token counts: 100 even buckets up to the limit.
    assert values['tgi_request_input_length_bucket{le="10.0"}'] == 0
    assert values['tgi_request_input_length_bucket{le="20.0"}'] == 1
    assert values['tgi_request_max_new_tokens_bucket{le="20.0"}'] == 1
    assert values['tgi_request_generated_tokens_bucket{le="2000.0"}'] == 1
    assert values["tgi_request_queue_duration_sum"] == 0.1


def test_count_failures_counts_typed_errors_only() -> None:
    class Typed(Exception):
        error_type = "overloaded"

    metrics = Metrics()
    for error in (Typed(), RuntimeError()):
        try:
            with metrics.count_failures():
                raise error
        except Exception:
            pass
    values = samples(metrics.render().decode())
    assert values['tgi_request_failure{err="overloaded"}'] == 1
    assert len([k for k in values if k.startswith("tgi_request_failure")]) == 1


def test_batch_inference_reads_the_shard_timings() -> None:
    metrics = Metrics()
    metrics.batch_inference("decode", 0.5, pb.StepResponse(forward_ns=2_000_000))
    metrics.batch_inference("prefill", 0.5, None)
    values = samples(metrics.render().decode())
    assert values['tgi_batch_inference_count{method="decode"}'] == 1
    assert values['tgi_batch_inference_count{method="prefill"}'] == 1
    assert values['tgi_batch_inference_success{method="decode"}'] == 1
    assert 'tgi_batch_inference_success{method="prefill"}' not in values
    assert values['tgi_batch_forward_duration_sum{method="decode"}'] == 0.002
    # TGI's concat histogram stays declared (TGI_NAMES) for its dashboards; no step fills it.
    assert not [k for k in values if k.startswith("tgi_batch_concat_duration")]


def test_apps_do_not_share_metrics() -> None:
    first, second = Metrics(), Metrics()
    first.request_received()
    assert samples(second.render().decode())["tgi_request_count"] == 0


def test_the_paged_engine_exports_its_kv_cache() -> None:
    metrics = Metrics()
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4))
    engine = PagedEngine(
        shards=None, scheduler=scheduler, max_concurrent_requests=4, metrics=metrics
    )  # type: ignore[arg-type]
    values = samples(metrics.render().decode())
    assert values["textgate_kv_cache_blocks_free"] == 8
    assert values["textgate_kv_cache_blocks_used"] == 0
    assert values["textgate_kv_cache_usage"] == 0
    assert values["textgate_prefix_cache_hit_tokens"] == 0
    assert values["textgate_preemptions"] == 0
    engine.scheduler.allocator.allocate(1, list(range(10)), 10)
    assert samples(metrics.render().decode())["textgate_kv_cache_blocks_used"] == 3


def test_kv_cache_watch_follows_the_latest_source() -> None:
    metrics = Metrics()
    metrics.watch_kv_cache(lambda: KvCacheStats(1, 1, 16, 0, 0, 0))
    metrics.watch_kv_cache(lambda: KvCacheStats(2, 6, 16, 5, 9, 3))
    values = samples(metrics.render().decode())
    assert values["textgate_kv_cache_blocks_used"] == 2
    assert values["textgate_kv_cache_usage"] == 0.25
    assert (values["textgate_prefix_cache_hit_tokens"], values["textgate_preemptions"]) == (5, 3)
    assert not any(name.startswith("textgate_kv_offload") for name in values)


def test_kv_tier_metrics_count_hits_per_tier_and_host_bytes() -> None:
    tiers = KvTierStats(
        hit_tokens={"device": 32, "host": 16, "disk": 48},
        num_offloaded_blocks=5,
        num_restored_blocks={"host": 1, "disk": 3},
        num_host_blocks=2,
        num_disk_blocks=7,
        block_bytes=1000,
    )
    metrics = Metrics()
    metrics.watch_kv_cache(lambda: KvCacheStats(2, 6, 16, 96, 200, 0, tiers))
    values = samples(metrics.render().decode())
    assert values['textgate_prefix_cache_tier_hit_tokens{tier="host"}'] == 16
    assert values['textgate_prefix_cache_tier_hit_tokens{tier="disk"}'] == 48
    assert values['textgate_kv_restore_blocks{tier="disk"}'] == 3
    assert values["textgate_kv_offload_blocks"] == 5
    assert values["textgate_kv_offload_host_bytes"] == 2000
    assert values["textgate_kv_offload_disk_blocks"] == 7


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(response.text)


async def test_metrics_route_has_tgis_names(router: httpx.AsyncClient) -> None:
    await router.post("/generate", json={"inputs": "w5", "parameters": {"max_new_tokens": 1}})
    text = (await router.get("/metrics")).text
    declared = types(text)
    for name in TGI_NAMES:
        assert name in declared, name


async def test_metrics_move_with_requests(router: httpx.AsyncClient, fake: FakeShard) -> None:
    before = await scrape(router)
    body: dict[str, Any] = {"inputs": "w5 w6", "parameters": {"max_new_tokens": 3}}
    assert (await router.post("/generate", json=body)).status_code == 200
    assert (await router.post("/generate_stream", json=body)).status_code == 200
    assert (await router.post("/generate", json={"inputs": ""})).status_code == 422
    fake.fail["Step"] = 1  # the third request's prefill step
    assert (await router.post("/generate", json=body)).status_code == 424
    after = await scrape(router)

    def moved(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert moved("tgi_request_count") == 4
    assert moved("tgi_request_success") == 2
    assert moved('tgi_request_failure{err="validation"}') == 1
    assert moved('tgi_request_failure{err="generation"}') == 1
    assert moved("tgi_request_duration_count") == 2
    assert moved("tgi_request_generated_tokens_sum") == 6
    assert moved("tgi_request_input_length_sum") == 6, "three validated requests of 2 tokens"
    assert moved("tgi_request_max_new_tokens_sum") == 9
    assert moved("tgi_request_inference_duration_count") == 2
    assert moved('tgi_batch_inference_count{method="prefill"}') == 3
    assert moved('tgi_batch_inference_success{method="prefill"}') == 2
    assert moved('tgi_batch_inference_count{method="decode"}') == 4
    assert moved("tgi_batch_next_size_count") == 3
    assert after["tgi_queue_size"] == 0
    assert after["tgi_batch_current_size"] == 0


async def test_a_failed_stream_counts_as_a_failure(
    router: httpx.AsyncClient, fake: FakeShard
) -> None:

    async def fail_second_step() -> None:  # the prefill step succeeds, a decode fails
        while not fake.calls_to("Step"):
            await asyncio.sleep(0.001)
        fake.fail["Step"] = 1

    fake.step_delay_s = 0.01
    failing = asyncio.create_task(fail_second_step())
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 4}}
    assert (await router.post("/generate_stream", json=body)).status_code == 200
    await failing
    values = await scrape(router)
    assert values['tgi_request_failure{err="generation"}'] == 1
    assert values.get("tgi_request_success", 0) == 0


async def test_overload_counts_and_batch_gauges_show_the_running_batch(
    start_router: StartRouter, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.02
    base_url = await start_router(max_concurrent_requests=1)
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        body = {"inputs": "w5 w6 w7", "parameters": {"max_new_tokens": 20}}
        slow = asyncio.create_task(client.post("/generate", json=body))
        for _ in range(100):
            values = await scrape(client)
            if values["tgi_batch_current_size"] == 1:
                break
            await asyncio.sleep(0.01)
        # The batch's KV-cache tokens: whole blocks, at most the 2 that 3 + 20 tokens fill.
        held = values["tgi_batch_current_max_tokens"]
        assert 0 < held <= 2 * fake.block_size and held % fake.block_size == 0
        assert (await client.post("/generate", json=body)).status_code == 429
        assert (await slow).status_code == 200
        values = await scrape(client)
        assert values['tgi_request_failure{err="overloaded"}'] == 1
        assert values["tgi_batch_current_size"] == 0


@pytest.fixture
async def paged_shards(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[ShardedClient]:
    """A real paged shard (tiny native model, 4-token blocks) on a unix socket."""
    from textgate.shard_server.loading.shard_loader import load_model
    from textgate.shard_server.server import serve
    from textgate.shard_server.startup.cache_config import CacheConfig

    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=CacheConfig(block_size=4))
    uds = str(tmp_path / "s")
    task = asyncio.create_task(serve(model, uds, rank=0, world_size=1))
    client = await ShardedClient.connect(uds, timeout_s=30)
    await client.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    yield client
    await client.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_paged_engine_records_its_steps(paged_shards: ShardedClient) -> None:
    metrics = Metrics()
    config = SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine = PagedEngine(paged_shards, Scheduler(config), 8, metrics=metrics)
    prompt = (5, 17, 42, 8, 9, 10, 11, 12, 13)
    request = ValidRequest(
        inputs="",
        input_ids=prompt,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=3, ignore_eos_token=True),
    )
    try:
        for _ in range(2):  # the second run hits the prefix cache
            (channel,) = engine.submit([request])
            await collect(channel)
    finally:
        await engine.close()
    values = samples(metrics.render().decode())
    # Run 1: 9 prompt tokens under an 8-token budget are two prefill steps (the second
    # one computes a single prompt token), then two decodes. Run 2: 8 prompt tokens come
    # from the prefix cache, one prefill step computes the ninth, then two decodes.
    assert values['tgi_batch_inference_count{method="prefill"}'] == 3
    assert values['tgi_batch_inference_success{method="decode"}'] == 4
    assert values['tgi_batch_forward_duration_count{method="decode"}'] == 4
    assert values['tgi_batch_filter_duration_count{method="prefill"}'] == 3
    assert values["tgi_batch_next_size_count"] == 2
    assert values["textgate_prefix_cache_hit_tokens"] == 8
    assert values["tgi_queue_size"] == 0
    assert values["tgi_batch_current_size"] == 0
    assert values["textgate_kv_cache_blocks_used"] == 0
