"""Router startup: warmup sizing, budget resolution, and the real process against a fake shard."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.config import RouterConfig
from textgate.router.engine.factory import make_engine
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.server import resolve_config, warmup_request
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard

INFO = pb.InfoResponse(dtype="bfloat16", device_type="cuda")


def test_warmup_asks_for_the_routers_limits(make_config: Callable[..., RouterConfig]) -> None:
    request = warmup_request(
        make_config(max_input_tokens=100, max_batch_prefill_tokens=250, max_batch_size=6)
    )
    assert (request.max_input_tokens, request.max_prefill_tokens, request.max_total_tokens) == (
        100,
        250,
        128,
    )
    assert request.max_batch_size == 6
    assert warmup_request(make_config()).max_batch_size == 0  # unset: the shard's default


def test_budget_defaults_when_the_shard_reports_no_capacity(
    make_config: Callable[..., RouterConfig],
) -> None:
    config = resolve_config(make_config(), INFO, None)
    assert config.max_batch_total_tokens == 16_000
    assert (config.model_dtype, config.model_device_type) == ("bfloat16", "cuda")
    pinned = resolve_config(make_config(max_batch_total_tokens=5000), INFO, None)
    assert pinned.max_batch_total_tokens == 5000


def test_budget_follows_the_shard_capacity(make_config: Callable[..., RouterConfig]) -> None:
    assert resolve_config(make_config(), INFO, 1000).max_batch_total_tokens == 1000
    capped = resolve_config(make_config(max_batch_total_tokens=900), INFO, 1000)
    assert capped.max_batch_total_tokens == 900
    lowered = resolve_config(make_config(max_batch_total_tokens=5000), INFO, 1000)
    assert lowered.max_batch_total_tokens == 1000
    small = resolve_config(make_config(), INFO, 200)
    assert (small.max_batch_total_tokens, small.max_batch_prefill_tokens) == (200, 200)


def test_a_cache_smaller_than_one_request_is_refused(
    make_config: Callable[..., RouterConfig],
) -> None:
    with pytest.raises(RuntimeError, match="lower max_total_tokens"):
        resolve_config(make_config(), INFO, 100)


async def test_the_engine_takes_the_shards_blocks(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig]
) -> None:
    config = make_config(max_batch_total_tokens=1000)
    with pytest.raises(RuntimeError, match="no KV-cache block size"):
        make_engine(config, sharded, pb.InfoResponse(), pb.WarmupResponse())
    paged = make_engine(
        config, sharded, pb.InfoResponse(block_size=16), pb.WarmupResponse(num_blocks=64)
    )
    assert isinstance(paged, PagedEngine)
    assert paged.scheduler.config.num_blocks == 64
    assert paged.scheduler.config.block_size == 16
    assert paged.scheduler.config.max_num_batched_tokens == config.max_batch_prefill_tokens
    with pytest.raises(RuntimeError, match="no KV-cache blocks"):
        make_engine(config, sharded, pb.InfoResponse(block_size=16), pb.WarmupResponse())


async def test_a_device_hour_cost_gives_the_engine_a_cost_meter(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig]
) -> None:
    info, warmup = pb.InfoResponse(block_size=16), pb.WarmupResponse(num_blocks=64)
    priced = make_engine(make_config(device_hour_cost=2.5), sharded, info, warmup)
    assert priced.cost is not None and priced.cost.device_hour_cost == 2.5
    assert make_engine(make_config(), sharded, info, warmup).cost is None


async def test_prompts_longer_than_the_prefill_budget_are_chunked(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig]
) -> None:
    config = make_config(max_batch_prefill_tokens=16)
    assert config.max_input_tokens > 16
    chunked = make_engine(
        config, sharded, pb.InfoResponse(block_size=16), pb.WarmupResponse(num_blocks=64)
    )
    assert isinstance(chunked, PagedEngine)
    assert chunked.scheduler.config.max_num_batched_tokens == 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def read_until(stream: asyncio.StreamReader, needle: str, timeout: float) -> list[str]:
    lines: list[str] = []

    async def read() -> list[str]:
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError("router exited:\n" + "".join(lines))
            lines.append(line)
            if needle in line:
                return lines

    return await asyncio.wait_for(read(), timeout)


async def test_router_process_serves_then_drains_on_sigterm(
    fake: FakeShard, make_config: Callable[..., RouterConfig], tokenizer_dir: Path
) -> None:
    port = free_port()
    config: dict[str, Any] = {
        **make_config(tokenizer_path=str(tokenizer_dir)).__dict__,
        "hostname": "127.0.0.1",
        "port": port,
        "json_output": True,
        "cors_allow_origin": [],
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "textgate.router",
        "--config-json",
        json.dumps(config),
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        lines = await read_until(process.stderr, "Router listening on", timeout=120)
        listening = json.loads(lines[-1])
        assert listening["message"] == f"Router listening on http://127.0.0.1:{port}"
        assert listening["level"] == "INFO"
        assert [name for name, _ in fake.calls[:5]] == [
            "ServiceDiscovery",
            "ClearCache",
            "Info",
            "Health",
            "Warmup",
        ]

        fake.step_delay_s = 0.02
        events = []
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client,
            client.stream(
                "POST",
                "/generate_stream",
                json={"inputs": "w5", "parameters": {"max_new_tokens": 20}},
            ) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
                    if len(events) == 1:
                        process.send_signal(signal.SIGTERM)
        assert len(events) == 20, "the in-flight stream finished after SIGTERM"
        assert events[-1]["generated_text"] is not None
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_router_process_rejects_a_bad_config() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "textgate.router",
        "--config-json",
        '{"model_id": "m", "tokenizer_path": "t", "nonsense": 1}',
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert b"nonsense" in stderr


def test_the_limits_in_force_are_logged_in_one_line() -> None:
    from textgate.proto import generate_pb2 as pb
    from textgate.router.server import limits_line

    config = RouterConfig(
        model_id="m",
        tokenizer_path="t",
        max_input_tokens=100,
        max_total_tokens=200,
        max_batch_prefill_tokens=256,
        max_batch_total_tokens=4096,
    )
    info = pb.InfoResponse(dtype="bfloat16", device_type="cpu", block_size=16, quantize="int8")
    line = limits_line(config, info, pb.WarmupResponse(num_blocks=256))
    for part in (
        "max_input_tokens=100",
        "max_total_tokens=200",
        "default_max_new_tokens=256",
        "max_batch_prefill_tokens=256",
        "max_batch_total_tokens=4096",
        "kv_cache=256 blocks x 16 tokens",
        "dtype=bfloat16",
        "quantize=int8",
    ):
        assert part in line
