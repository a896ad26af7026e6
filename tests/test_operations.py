"""The launcher in operation (tiny model): a collector that is down changes nothing,
SIGTERM drains the streams and stops everything, a signal during loading stops it.

One traced launcher serves the first two tests (the second stops it); it traces to a
port nobody listens on, drains for up to 60 s and paces streams to 50 tokens/s, so a
100-token stream lasts 2 s whatever the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.launcher import free_port

GREEDY = {"inputs": "The quick brown", "parameters": {"max_new_tokens": 20, "details": True}}


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, launch_server: Any
) -> Iterator[tuple[Any, Any]]:
    """(traced, plain) launchers, started side by side."""
    collector = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tmp = tmp_path_factory.mktemp("traced")
    traced = launch_server(
        tmp,
        *("--model-id", str(tiny_model_dir), "--otlp-endpoint", collector),
        *("--graceful-termination-timeout", "60", "--max-stream-rate", "50"),
    )
    traced.collector = collector
    plain = launch_server(tmp_path_factory.mktemp("plain"), "--model-id", str(tiny_model_dir))
    try:
        traced.wait_ready()
        plain.wait_ready()
        yield traced, plain
    finally:
        traced.stop()
        plain.stop()


@pytest.fixture(scope="module")
def traced_server(servers: tuple[Any, Any]) -> Any:
    return servers[0]


@pytest.fixture(scope="module")
def plain_server(servers: tuple[Any, Any]) -> str:
    return str(servers[1].url)


def _generate(url: str) -> tuple[list[int], float]:
    started = time.monotonic()
    response = httpx.post(f"{url}/generate", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]], time.monotonic() - started


def test_an_unreachable_collector_leaves_serving_unaffected(
    traced_server: Any, plain_server: str
) -> None:
    urls = {"plain": plain_server, "traced": traced_server.url}
    tokens: dict[str, list[list[int]]] = {name: [] for name in urls}
    times: dict[str, list[float]] = {name: [] for name in urls}
    for _ in range(4):  # alternated, so both see the same machine load
        for name, url in urls.items():
            ids, seconds = _generate(url)
            tokens[name].append(ids)
            times[name].append(seconds)
    assert tokens["traced"] == tokens["plain"], "the same greedy tokens with tracing on"
    assert len(tokens["traced"][0]) == 20
    # Generous (the machine is shared): the export runs in a background thread.
    assert statistics.median(times["traced"]) < 3 * statistics.median(times["plain"]) + 0.2, times


def _children(launcher_pid: int) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True
    ).stdout.split()
    return [int(pid) for pid in found]


async def _stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> list[dict]:
    parameters = {"max_new_tokens": 100, "ignore_eos": True, "details": True}
    body = {"inputs": "The quick brown", "parameters": parameters}
    events = []
    async with client.stream("POST", f"{url}/generate_stream", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                started.set()
    return events


async def _drain_while_streaming(server: Any) -> tuple[list[list[dict]], list[bool]]:
    """4 streams run; SIGTERM; /health and a new request get 503 while they still run."""
    async with httpx.AsyncClient(timeout=60) as client:
        flags = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(_stream(client, server.url, f)) for f in flags]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
        server.process.send_signal(signal.SIGTERM)
        for _ in range(100):
            if (await client.get(f"{server.url}/health")).status_code == 503:
                break
            await asyncio.sleep(0.05)
        refused = await client.post(f"{server.url}/generate", json=GREEDY)
        still_running = [not s.done() for s in streams]
        assert refused.status_code == 503, refused.text
        assert refused.json()["error_type"] == "shutting_down"
        return list(await asyncio.gather(*streams)), still_running


def test_sigterm_drains_the_streams_then_stops_everything(traced_server: Any) -> None:
    children = _children(traced_server.process.pid)
    assert len(children) == 2, "one shard and the router"
    streams, still_running = asyncio.run(_drain_while_streaming(traced_server))
    assert any(still_running), "the 503s came while streams were still running"
    for events in streams:
        assert len(events) == 100
        assert events[-1]["details"]["finish_reason"] == "length"
        assert events[-1]["generated_text"] is not None
    assert traced_server.process.wait(60) == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    log = traced_server.log_path.read_text()
    assert "Draining: 4 requests in flight" in log
    assert "Traceback" not in log
    # The spans were really sent to the closed port, and dropped with one warning each.
    assert f"export to {traced_server.collector} failed" in log


def test_a_signal_while_the_shards_load_stops_the_launcher(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    argv = [sys.executable, "-m", "textgate.launcher", "--model-id", str(tiny_model_dir)]
    argv += ["--port", str(free_port()), "--shard-uds-path", str(tmp_path / "s")]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (shards := _children(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert shards, "the shard never started"
        # The shard is still importing torch: far from ready.
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "Stopping while the model loads" in stderr
    assert "Shard 0 ready" not in stderr
    for pid in shards:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
