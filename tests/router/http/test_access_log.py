"""One access-log line per request, in text and JSON, with what generation did."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from textgate.logs import JsonFormatter

ACCESS = "textgate.router.access"


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS]


async def test_a_generation_logs_one_line_with_its_tokens(
    router: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=ACCESS)
    body = {"inputs": "w5 w6", "parameters": {"max_new_tokens": 3}}
    assert (await router.post("/generate", json=body)).status_code == 200
    (record,) = access_records(caplog)
    assert record.levelno == logging.INFO
    fields = record.request  # type: ignore[attr-defined]
    assert fields["method"] == "POST" and fields["path"] == "/generate"
    assert fields["status"] == 200
    assert fields["input_tokens"] == 2 and fields["generated_tokens"] == 3
    assert fields["max_new_tokens"] == 3
    assert fields["inference_s"] >= 0 and fields["queue_s"] >= 0
    assert record.getMessage().startswith("POST /generate 200 ")
    assert "generated_tokens=3" in record.getMessage()
    line = json.loads(JsonFormatter("router").format(record))
    assert line["request"] == fields and line["target"] == ACCESS
    assert line["process"] == "router"


async def test_a_stream_is_logged_once_after_its_last_event(
    router: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 4}}
    async with router.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass
    (record,) = access_records(caplog)
    fields = record.request  # type: ignore[attr-defined]
    assert fields["path"] == "/generate_stream" and fields["generated_tokens"] == 4


async def test_failures_are_logged_with_their_error_type_and_probes_are_quiet(
    router: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    bad = await router.post("/generate", json={"inputs": "w5", "parameters": {"top_k": 0}})
    assert bad.status_code == 422
    assert (await router.get("/health")).status_code == 200
    (record,) = access_records(caplog)
    fields = record.request  # type: ignore[attr-defined]
    assert fields["status"] == 422 and fields["error_type"] == "validation"
