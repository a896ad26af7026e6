"""Two "nodes" as two launchers on 127.0.0.1 (gloo over TCP), `--num-shard 2 --nnodes 2`:
node 0 runs the router and rank 0, node 1 is headless with rank 1, which the router calls
over TCP. Greedy answers equal one shard's (the shared live server, the embedded default
model in float32); killing node 1's shard mid-stream ends the streams with error events
and stops both launchers within 5 s; SIGTERM to both at once (a LeaderWorkerSet group
deleted) lets the streams finish and stops both cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.launcher import free_port

pytestmark = pytest.mark.e2e

PROMPTS = ["Paris is the capital", "The quick brown fox", "Continuous batching keeps"]
GOAL_S = 5.0
"""Issue 30: any rank dying stops every node within this."""


def _free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 right now."""
    for _ in range(50):
        first = free_port()
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        if first + count < 65536:
            return first
    raise RuntimeError("no run of free ports")


def _group(launch_server: Any, tmp_path: Path) -> tuple[Any, Any]:
    """Node 1 (headless) and node 0 (the router), started; node 0 serving."""
    shard_port = _free_ports(2)
    common = [
        "--num-shard", "2", "--nnodes", "2", "--dtype", "float32",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--shard-port", str(shard_port),
    ]  # fmt: skip
    (tmp_path / "node1").mkdir()
    (tmp_path / "node0").mkdir()
    # The headless node starts first: the ranks wait for each other whatever the order.
    node1 = launch_server(tmp_path / "node1", *common, "--node-rank", "1")
    node0 = launch_server(tmp_path / "node0", *common, "--node-rank", "0")
    try:
        node0.wait_ready()
    except BaseException:
        node0.stop()
        node1.stop()
        raise
    assert node1.process.poll() is None, node1.log_path.read_text()[-4000:]
    return node0, node1


@pytest.fixture
def group(launch_server: Any, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    node0, node1 = _group(launch_server, tmp_path)
    try:
        yield node0, node1
    finally:
        node0.stop()
        node1.stop()


def _greedy_tokens(url: str, prompt: str) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


async def _stream(url: str, started: asyncio.Event, max_new_tokens: int) -> list[dict]:
    parameters = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "details": True}
    body = {"inputs": "Once upon a time", "parameters": parameters}
    events = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/generate_stream", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                started.set()
    return events


def _shard_pids(launcher_pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _exit_times(processes: list[subprocess.Popen[str]], since: float, limit: float) -> list[float]:
    """Seconds from `since` until each process exited (waiting at most `limit` in all)."""
    times: list[float | None] = [None] * len(processes)
    while None in times and time.monotonic() - since < limit:
        for i, process in enumerate(processes):
            if times[i] is None and process.poll() is not None:
                times[i] = time.monotonic() - since
        time.sleep(0.02)
    return [t if t is not None else float("inf") for t in times]


async def _kill_mid_stream(node0: Any, victim: int) -> tuple[list[list[dict]], float]:
    flags = [asyncio.Event() for _ in range(2)]
    streams = [asyncio.create_task(_stream(node0.url, f, 400)) for f in flags]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 120)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    return list(results), killed


def test_two_nodes_answer_like_one_shard_and_stop_together_when_a_rank_dies(
    live_server: str, group: tuple[Any, Any]
) -> None:
    node0, node1 = group
    for prompt in PROMPTS:
        assert _greedy_tokens(node0.url, prompt) == _greedy_tokens(live_server, prompt), prompt
    info = httpx.get(f"{node0.url}/info").json()
    assert info["model_id"] and info["model_dtype"] == "float32"

    (rank1,) = _shard_pids(node1.process.pid)
    streams, killed = asyncio.run(_kill_mid_stream(node0, rank1))
    exited = _exit_times([node0.process, node1.process], killed, 30)
    for events in streams:
        assert "error" in events[-1], events[-1]
        assert events[-1]["error_type"] == "generation"
        assert all("error" not in e for e in events[:-1]) and len(events) < 400
    assert max(exited) < GOAL_S, f"launchers exited {exited} s after the kill"
    assert node0.process.returncode == 1 and node1.process.returncode == 1
    log0, log1 = node0.log_path.read_text(), node1.log_path.read_text()
    assert "rank 1 (node 1) at 127.0.0.1:" in log0 and "stopped answering" in log0
    assert "shard 1 exited with code -9" in log1
    for launcher in (node0, node1):
        assert not _shard_pids(launcher.process.pid)


async def _sigterm_both_mid_stream(node0: Any, node1: Any) -> list[dict]:
    started = asyncio.Event()
    stream = asyncio.create_task(_stream(node0.url, started, 24))
    await asyncio.wait_for(started.wait(), 120)
    node0.process.send_signal(signal.SIGTERM)
    node1.process.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(stream, 120)


def test_sigterm_to_the_whole_group_drains_then_stops_every_node(
    group: tuple[Any, Any],
) -> None:
    node0, node1 = group
    events = asyncio.run(_sigterm_both_mid_stream(node0, node1))
    assert len(events) == 24 and events[-1]["details"]["finish_reason"] == "length"
    assert node0.process.wait(60) == 0
    assert node1.process.wait(30) == 0, node1.log_path.read_text()[-3000:]
    assert "Stopping once rank 0 has stopped" in node1.log_path.read_text()
