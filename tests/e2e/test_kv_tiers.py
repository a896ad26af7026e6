"""End to end: the host and disk KV tiers on the embedded model with a deliberately small
device cache. A long prompt's prefix, evicted by other prompts, comes back from the host
tier with the same greedy text; a launcher restarted on the same --kv-offload-dir restores
it from disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # float32 SmolLM2-135M: layers, block, kv heads, dim
SMALL_CACHE = [
    "--dtype", "float32",
    "--kv-cache-memory", str(24 * BLOCK_BYTES),  # 384 tokens: one ~190-token prompt and a bit
    "--max-input-tokens", "300",
    "--max-total-tokens", "340",
]  # fmt: skip


def prompt(k: int) -> str:
    """About 190 tokens, different for each k from the first token on."""
    return f"Document {k}: " + " ".join(f"item{(i * 7 + k) % 97}" for i in range(65))


def generate(url: str, text: str) -> str:
    body = {"inputs": text, "parameters": {"max_new_tokens": 6, "do_sample": False}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["generated_text"])


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(("textgate_kv_", "textgate_prefix_cache")):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def evict_with_others(url: str) -> None:
    """Two other long prompts: the device cache cannot keep the first one's blocks."""
    for k in (2, 3):
        generate(url, prompt(k))


def test_an_evicted_prefix_comes_back_from_the_host_tier(
    launch_server: Any, tmp_path: Path
) -> None:
    server = launch_server(tmp_path, *SMALL_CACHE, "--kv-offload-bytes", str(200 * BLOCK_BYTES))
    try:
        server.wait_ready()
        first = generate(server.url, prompt(1))
        evict_with_others(server.url)
        before = metrics(server.url)
        assert before["textgate_kv_offload_blocks"] >= 10
        assert generate(server.url, prompt(1)) == first
        after = metrics(server.url)
        host_hits = 'textgate_prefix_cache_tier_hit_tokens{tier="host"}'
        assert after[host_hits] - before[host_hits] >= 160  # most of the prompt's 11 full blocks
        assert after['textgate_kv_restore_blocks{tier="host"}'] >= 10
        assert after["textgate_kv_offload_host_bytes"] > 0
    finally:
        server.stop()


def test_the_disk_tier_survives_a_restart(launch_server: Any, tmp_path: Path) -> None:
    tier = tmp_path / "kv"
    flags = [*SMALL_CACHE, "--kv-offload-dir", str(tier)]  # no host bytes: straight to disk
    (tmp_path / "first").mkdir()
    server = launch_server(tmp_path / "first", *flags)
    try:
        server.wait_ready()
        first = generate(server.url, prompt(1))
        evict_with_others(server.url)
        assert metrics(server.url)["textgate_kv_offload_disk_blocks"] >= 10
    finally:
        assert server.stop() == 0  # a clean stop: the writer thread finishes its files
    assert len(list(tier.glob("*/*.kv"))) >= 10
    (tmp_path / "second").mkdir()
    server = launch_server(tmp_path / "second", *flags)
    try:
        server.wait_ready()
        assert metrics(server.url)["textgate_kv_offload_disk_blocks"] >= 10
        assert generate(server.url, prompt(1)) == first
        values = metrics(server.url)
        assert values['textgate_prefix_cache_tier_hit_tokens{tier="disk"}'] >= 160
        assert values['textgate_kv_restore_blocks{tier="disk"}'] >= 10
    finally:
        server.stop()
