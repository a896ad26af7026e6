"""The vLLM-named series routers read (the endpoint picker, llm-d): their names, labels and
meaning as vLLM's, and that /metrics moves them with the router's own queue, batch, KV
cache and adapters."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import textgate
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.metrics import Metrics
from textgate.router.metrics_collectors import AdapterStats, KvCacheStats
from textgate.tests.router import fake_shard
from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.test_metrics import samples, types

StartRouter = Callable[..., Awaitable[str]]
MAX_LORAS = 4

LORA_INFO = re.compile(
    r'^vllm:lora_requests_info\{max_lora="(\d+)",running_lora_adapters="([^"]*)",'
    r'waiting_lora_adapters="([^"]*)"\} (\S+)$',
    flags=re.MULTILINE,
)


def lora_info(text: str) -> list[tuple[str, str, str, float]]:
    """(max_lora, running, waiting, value) of every `vllm:lora_requests_info` series."""
    return [(m, r, w, float(v)) for m, r, w, v in LORA_INFO.findall(text)]


def test_waiting_and_running_are_the_tgi_gauges_under_vllms_names() -> None:
    metrics = Metrics()
    metrics.queue_size(3)
    metrics.running_batch(2, 64)
    text = metrics.render().decode()
    values = samples(text)
    assert (values["vllm:num_requests_waiting"], values["tgi_queue_size"]) == (3, 3)
    assert (values["vllm:num_requests_running"], values["tgi_batch_current_size"]) == (2, 2)
    assert types(text)["vllm:num_requests_waiting"] == "gauge"
    assert types(text)["vllm:num_requests_running"] == "gauge"


def test_kv_cache_usage_is_a_fraction_and_the_layout_is_in_labels() -> None:
    metrics = Metrics()
    metrics.watch_kv_cache(lambda: KvCacheStats(3, 9, 16, 0, 0, 0))
    values = samples(metrics.render().decode())
    assert values["vllm:kv_cache_usage_perc"] == 0.25  # 3 of 12 blocks, not 25
    assert values['vllm:cache_config_info{block_size="16",num_gpu_blocks="12"}'] == 1


def test_lora_info_lists_adapters_with_requests_and_stamps_the_time() -> None:
    metrics = Metrics()
    metrics.watch_adapters(lambda: AdapterStats(0, {}, {}))
    assert "vllm:lora_requests_info" not in metrics.render().decode(), "no adapters, no series"
    metrics.watch_adapters(lambda: AdapterStats(8, {"sql": 2, "idle": 0, "art": 1}, {"poet": 1}))
    before = time.time()
    ((max_lora, running, waiting, stamp),) = lora_info(metrics.render().decode())
    assert (max_lora, running, waiting) == ("8", "art,sql", "poet")
    assert before <= stamp <= time.time()


class LoraFakeShard(FakeShard):
    """The fake shard, reporting that its model takes up to MAX_LORAS adapters."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls)
        self.max_loras = MAX_LORAS


@pytest.fixture
async def fake(uds_path: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeShard]:
    """Rank 0 of a one-shard fake model that takes LoRA adapters (overrides conftest's)."""
    monkeypatch.setattr(fake_shard, "FakeShard", LoraFakeShard)
    async with fake_shard.fake_shards(uds_path) as shards:
        yield shards[0]


async def scrape(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return response.text


async def wait_for(client: httpx.AsyncClient, ready: Callable[[dict[str, float]], bool]) -> str:
    """The first scrape whose samples satisfy `ready` (within about a second)."""
    for _ in range(100):
        text = await scrape(client)
        if ready(samples(text)):
            return text
        await asyncio.sleep(0.01)
    raise AssertionError(f"/metrics never got there:\n{text}")


async def test_metrics_route_moves_the_vllm_series_with_a_queued_request(
    start_router: StartRouter, fake: FakeShard
) -> None:
    fake.lora_adapters = ["sql", "poet"]
    fake.step_delay_s = 0.02
    # One running request at a time: the second one queues behind the first.
    base_url = await start_router(max_batch_size=1)
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        idle = await scrape(client)
        assert samples(idle)["vllm:num_requests_waiting"] == 0
        assert samples(idle)["vllm:kv_cache_usage_perc"] == 0
        assert lora_info(idle)[0][:3] == (str(MAX_LORAS), "", "")

        def body(adapter: str) -> dict[str, Any]:
            return {
                "inputs": "w5 w6 w7",
                "parameters": {"max_new_tokens": 30, "adapter_id": adapter},
            }

        first = asyncio.create_task(client.post("/generate", json=body("sql")))
        await wait_for(client, lambda v: v["vllm:num_requests_running"] == 1)
        second = asyncio.create_task(client.post("/generate", json=body("poet")))
        busy = await wait_for(client, lambda v: v["vllm:num_requests_waiting"] == 1)
        values = samples(busy)
        assert values["vllm:num_requests_running"] == 1
        # The running request's blocks over the fake shard's pool, as a fraction.
        used, free = (
            values["textgate_kv_cache_blocks_used"],
            values["textgate_kv_cache_blocks_free"],
        )
        assert 0 < values["vllm:kv_cache_usage_perc"] == used / (used + free) < 1
        block_size, num_blocks = str(fake.block_size), str(fake.num_blocks)
        config_key = (
            f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{num_blocks}"}}'
        )
        assert values[config_key] == 1
        assert lora_info(busy)[0][:3] == (str(MAX_LORAS), "sql", "poet")

        assert [(await r).status_code for r in (first, second)] == [200, 200]
        done = await scrape(client)
        values = samples(done)
        assert (values["vllm:num_requests_waiting"], values["vllm:num_requests_running"]) == (0, 0)
        assert values["vllm:kv_cache_usage_perc"] == 0
        assert lora_info(done)[0][:3] == (str(MAX_LORAS), "", "")


def test_the_paged_engine_exports_lora_info_only_for_a_model_that_takes_adapters() -> None:
    for max_loras in (0, 2):
        metrics = Metrics()
        scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4))
        PagedEngine(
            shards=None,  # type: ignore[arg-type]
            scheduler=scheduler,
            max_concurrent_requests=4,
            metrics=metrics,
            max_loras=max_loras,
        )
        found = lora_info(metrics.render().decode())
        assert [i[:3] for i in found] == ([("2", "", "")] if max_loras else [])


def test_docs_scaling_lists_every_vllm_series_the_router_exports() -> None:
    metrics = Metrics()
    metrics.watch_kv_cache(lambda: KvCacheStats(1, 3, 16, 0, 0, 0))
    metrics.watch_adapters(lambda: AdapterStats(2, {}, {}))
    exported = {name for name in types(metrics.render().decode()) if name.startswith("vllm:")}
    doc = (Path(textgate.__file__).parent / "docs" / "scaling.md").read_text()
    documented = set(re.findall(r"^\| `(vllm:\w+)` \|", doc, flags=re.MULTILINE))
    assert documented == exported
