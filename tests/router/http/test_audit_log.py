"""The audit log over real HTTP: one JSON line per request (TGI, OpenAI, a stream) with its
tenant, route, tokens, status and latency, no text unless asked, rotation by size, and an
unwritable path that fails no request; and the per-tenant queue and TTFT histograms."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.router.http.audit_log import AuditLog
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter, chat

KEYS = "keys:\n  - {key: sk-a, tenant: team-a}\n  - {key: sk-b, tenant: team-b}\n"


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


async def audit_lines(path: Path, count: int) -> list[dict[str, Any]]:
    """The file's lines once it has `count` (the writer is a thread of its own)."""
    for _ in range(500):
        if path.exists():
            lines = path.read_text().splitlines()
            if len(lines) >= count:
                assert len(lines) == count, lines
                return [json.loads(line) for line in lines]
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} did not get {count} lines")


async def serve(start_router: StartRouter, tmp_path: Path, **config: Any) -> httpx.AsyncClient:
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    url = await start_router(ChatFakeTokenizer(), api_keys_file=str(keys), **config)
    return httpx.AsyncClient(base_url=url, timeout=10)


async def test_each_request_gets_one_line_without_its_text(
    start_router: StartRouter, tmp_path: Path
) -> None:
    path = tmp_path / "audit.jsonl"
    async with await serve(start_router, tmp_path, audit_log=str(path)) as client:
        tgi = {"inputs": "w5 w6", "parameters": {"max_new_tokens": 3}}
        headers = auth("sk-a", **{"x-request-id": "req-1"})
        assert (await client.post("/generate", json=tgi, headers=headers)).status_code == 200
        body = chat(max_tokens=2)
        answer = await client.post("/v1/chat/completions", json=body, headers=auth("sk-b"))
        assert answer.status_code == 200
        stream = {"inputs": "w7", "parameters": {"max_new_tokens": 4}}
        async with client.stream(
            "POST", "/generate_stream", json=stream, headers=auth("sk-a")
        ) as response:
            async for _ in response.aiter_bytes():
                pass
        assert (await client.get("/health")).status_code == 200  # probes are not audited
        generate, completion, streamed = await audit_lines(path, 3)
    assert generate["tenant"] == "team-a" and generate["route"] == "/generate"
    assert generate["model"] == "fake-model" and generate["status"] == 200
    assert generate["prompt_tokens"] == 2 and generate["generated_tokens"] == 3
    assert generate["finish_reason"] == "length" and generate["request_id"] == "req-1"
    assert generate["latency_ms"] >= 0
    offset = datetime.fromisoformat(generate["time"]).utcoffset()
    assert offset is not None and offset.total_seconds() == 0  # UTC
    assert completion["tenant"] == "team-b" and completion["route"] == "/v1/chat/completions"
    assert completion["generated_tokens"] == 2 and completion["status"] == 200
    assert streamed["route"] == "/generate_stream" and streamed["generated_tokens"] == 4
    assert streamed["finish_reason"] == "length"
    for line in (generate, completion, streamed):
        assert "prompt" not in line and "output" not in line


async def test_the_content_flag_adds_the_prompt_and_output(
    start_router: StartRouter, tmp_path: Path
) -> None:
    path = tmp_path / "audit.jsonl"
    async with await serve(
        start_router, tmp_path, audit_log=str(path), audit_log_content=True
    ) as client:
        tgi = {"inputs": "w5 w6", "parameters": {"max_new_tokens": 3}}
        answer = await client.post("/generate", json=tgi, headers=auth("sk-a"))
        (line,) = await audit_lines(path, 1)
    assert line["prompt"] == "w5 w6"
    assert line["output"] == answer.json()["generated_text"] and line["output"]


async def test_an_unwritable_path_fails_no_request_and_warns_once(
    start_router: StartRouter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="textgate.router.audit")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "audit.jsonl"  # a file's "folder": can never be opened
    async with await serve(start_router, tmp_path, audit_log=str(path)) as client:
        tgi = {"inputs": "w5", "parameters": {"max_new_tokens": 2}}
        for _ in range(3):
            assert (
                await client.post("/generate", json=tgi, headers=auth("sk-a"))
            ).status_code == 200
        for _ in range(200):
            if caplog.records:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    warnings = [r for r in caplog.records if r.name == "textgate.router.audit"]
    assert len(warnings) == 1 and "cannot write" in warnings[0].getMessage()


def test_the_file_is_rotated_past_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), max_bytes=1000, backups=2)
    audit.start()
    for n in range(60):
        audit.write({"tenant": "t", "route": "/generate", "n": n})
    audit.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "audit.jsonl",
        "audit.jsonl.1",
        "audit.jsonl.2",
    ]
    for file in tmp_path.iterdir():
        assert file.stat().st_size <= 1000
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["n"] == 59


async def test_queue_time_and_ttft_are_histograms_per_tenant(
    start_router: StartRouter, tmp_path: Path
) -> None:
    async with await serve(start_router, tmp_path) as client:
        tgi = {"inputs": "w5", "parameters": {"max_new_tokens": 2}}
        await client.post("/generate", json=tgi, headers=auth("sk-a"))
        await client.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth("sk-b"))
        stream = {"inputs": "w7", "parameters": {"max_new_tokens": 2}}
        async with client.stream(
            "POST", "/generate_stream", json=stream, headers=auth("sk-b")
        ) as response:
            async for _ in response.aiter_bytes():
                pass
        text = (await client.get("/metrics")).text
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("textgate_tenant_request_") and "_count{" in line
    }
    for name in ("queue_duration", "time_to_first_token"):
        assert counts[f'textgate_tenant_request_{name}_count{{tenant="team-a"}}'] == 1
        assert counts[f'textgate_tenant_request_{name}_count{{tenant="team-b"}}'] == 2
    buckets = [
        line
        for line in text.splitlines()
        if line.startswith("textgate_tenant_request_time_to_first_token_bucket{")
        and 'tenant="team-a"' in line
    ]
    assert len(buckets) == 36  # TGI's 35 duration buckets and +Inf
