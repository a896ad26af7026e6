"""The soaked server: start it, read its processes' memory and its /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from textgate.bench.serving.sweep import free_port, launcher_command, stop_process, wait_healthy


def tree_rss_bytes(root_pid: int) -> int:
    """Resident memory of `root_pid` and all its descendants (launcher, router, shards)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # After the command name (which may hold spaces): state, then the parent's pid.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss[int(entry.name)] = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    tree = {root_pid}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(rss.get(pid, 0) for pid in tree)


GAUGES = (
    "textgate_kv_cache_blocks_used",
    "textgate_kv_cache_blocks_free",
    "tgi_batch_current_size",
    "tgi_queue_size",
)
"""What must be back to idle at the end (KV blocks, batch, queue)."""
TOTALS = (
    "tgi_request_queue_duration_sum",
    "tgi_request_queue_duration_count",
    "tgi_request_inference_duration_sum",
    "tgi_request_inference_duration_count",
    "tgi_request_generated_tokens_sum",
)
"""Running totals whose differences over a window split a request's time into its wait in
the queue (the scheduler's doing) and its inference (the machine's speed)."""


async def read_metrics(
    client: httpx.AsyncClient, names: tuple[str, ...] = GAUGES
) -> dict[str, float]:
    """The values of `names` (unlabelled series) from the server's /metrics."""
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 10.0) -> dict[str, float]:
    """The gauges once nothing is used, running or queued (or as they are at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = await read_metrics(client)
        busy = [
            gauges.get(n, 0)
            for n in ("textgate_kv_cache_blocks_used", "tgi_batch_current_size", "tgi_queue_size")
        ]
        if not any(busy) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.1)


@dataclass(frozen=True)
class LaunchedServer:
    url: str
    pid: int
    log: Path
    """The launcher's stdout and stderr (the router's access log is in it)."""


@contextlib.contextmanager
def launched_server(extra_args: list[str]) -> Iterator[LaunchedServer]:
    """A launcher (default model) on a free port, stopped on the way out."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="textgate-soak-", suffix=".log")[1])
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            launcher_command(extra_args)(port),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"soak: launcher pid {process.pid}, log {log_path}", file=sys.stderr)
    try:
        wait_healthy(url, process, log_path, timeout_s=900)
        yield LaunchedServer(url, process.pid, log_path)
    finally:
        stop_process(process)
