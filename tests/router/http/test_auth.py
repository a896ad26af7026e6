"""API keys over real HTTP: 401 in each API's shape, per-tenant quotas answered 429 with an
honest Retry-After, tokens settled to what was generated, max_new_tokens and models limits,
priority classes, deadlines and fair shares between tenants, SIGHUP reloads under a
running stream, and what /metrics and the access log show."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.tests.router.fake_clock import FakeClock
from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter, chat

KEYS = """
keys:
  - {key: sk-open, tenant: open}
  - {key: sk-rpm, tenant: rpm, requests_per_minute: 2}
  - {key: sk-tpm, tenant: tpm, tokens_per_minute: 40}
  - {key: sk-refund, tenant: refund, tokens_per_minute: 150}
  - {key: sk-conc, tenant: conc, max_concurrent: 1}
  - {key: sk-short, tenant: short, max_new_tokens: 5}
  - {key: sk-adapter, tenant: adapter-only, models: [sql]}
  - {key: sk-base, tenant: base-only, models: [fake-model]}
  - {key: sk-low, tenant: low, priority: 1}
  - {key: sk-hurry, tenant: hurry, timeout_s: 0.25}
"""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tgi(max_new_tokens: int | None = 3, **parameters: Any) -> dict[str, Any]:
    if max_new_tokens is not None:
        parameters["max_new_tokens"] = max_new_tokens
    return {"inputs": "w5", "parameters": parameters}


def message(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tgi",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "w5"}],
    } | fields


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def client(
    start_router: StartRouter, keys_file: Path, clock: FakeClock, fake: FakeShard
) -> Any:
    fake.lora_adapters = ["sql", "poet"]
    base_url = await start_router(ChatFakeTokenizer(), clock=clock, api_keys_file=str(keys_file))
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        yield http


async def test_a_missing_or_wrong_key_is_401_in_each_apis_shape(client: httpx.AsyncClient) -> None:
    for headers in ({}, auth("sk-nope"), {"Authorization": "sk-open"}):
        answer = await client.post("/generate", json=tgi(), headers=headers)
        assert answer.status_code == 401
        assert answer.json() == {"error": "Unauthorized", "error_type": "unauthorized"}
        openai = await client.post("/v1/chat/completions", json=chat(), headers=headers)
        assert openai.status_code == 401
        assert openai.json()["error"]["type"] == "authentication_error"
        assert openai.json()["error"]["code"] == "invalid_api_key"
        anthropic = await client.post("/v1/messages", json=message(), headers=headers)
        assert anthropic.status_code == 401
        assert anthropic.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Unauthorized"},
        }
    assert (await client.post("/generate", json=tgi(), headers=auth("sk-open"))).status_code == 200
    right = await client.post("/v1/messages", json=message(), headers={"x-api-key": "sk-open"})
    assert right.status_code == 200
    # Probes and scrapers still carry no key.
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


async def test_requests_per_minute_is_429_in_each_shape_with_an_honest_retry_after(
    client: httpx.AsyncClient, clock: FakeClock
) -> None:
    for _ in range(2):
        assert (
            await client.post("/generate", json=tgi(), headers=auth("sk-rpm"))
        ).status_code == 200
        clock.now += 0.75
    refused = await client.post("/generate", json=tgi(), headers=auth("sk-rpm"))
    assert refused.status_code == 429
    assert refused.json()["error_type"] == "rate_limited"
    assert "requests per minute: limit 2" in refused.json()["error"]
    # The first request leaves the window 60 s after it came, 1.5 s ago: 58.5 s, rounded up.
    assert refused.headers["retry-after"] == "59"
    openai = await client.post("/v1/chat/completions", json=chat(), headers=auth("sk-rpm"))
    assert openai.status_code == 429 and openai.headers["retry-after"] == "59"
    assert openai.json()["error"]["type"] == "rate_limit_error"
    assert openai.json()["error"]["code"] == "rate_limit_exceeded"
    anthropic = await client.post("/v1/messages", json=message(), headers={"x-api-key": "sk-rpm"})
    assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "59"
    assert anthropic.json()["error"]["type"] == "rate_limit_error"
    clock.now += 58
    assert (await client.post("/generate", json=tgi(), headers=auth("sk-rpm"))).status_code == 429
    clock.now += 1
    assert (await client.post("/generate", json=tgi(), headers=auth("sk-rpm"))).status_code == 200
    # Other tenants are counted apart.
    assert (await client.post("/generate", json=tgi(), headers=auth("sk-open"))).status_code == 200


async def test_tokens_per_minute_is_429_until_the_window_frees_enough(
    client: httpx.AsyncClient, clock: FakeClock
) -> None:
    # 1 prompt token + 30 generated: 31 of the 40.
    first = await client.post("/generate", json=tgi(30), headers=auth("sk-tpm"))
    assert first.status_code == 200
    clock.now += 5.5
    refused = await client.post("/generate", json=tgi(30), headers=auth("sk-tpm"))
    assert refused.status_code == 429 and refused.json()["error_type"] == "rate_limited"
    assert "tokens per minute: limit 40, used 31, requested 31" in refused.json()["error"]
    assert refused.headers["retry-after"] == "55"
    openai = await client.post(
        "/v1/chat/completions", json=chat(max_tokens=30), headers=auth("sk-tpm")
    )
    assert openai.status_code == 429 and openai.json()["error"]["code"] == "rate_limit_exceeded"
    anthropic = await client.post(
        "/v1/messages", json=message(max_tokens=30), headers={"x-api-key": "sk-tpm"}
    )
    assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == "rate_limit_error"
    # Less fits at once: 31 + 1 + 8 = 40.
    assert (await client.post("/generate", json=tgi(8), headers=auth("sk-tpm"))).status_code == 200
    clock.now += int(refused.headers["retry-after"]) - 1
    assert (await client.post("/generate", json=tgi(30), headers=auth("sk-tpm"))).status_code == 429
    clock.now += 1
    assert (await client.post("/generate", json=tgi(30), headers=auth("sk-tpm"))).status_code == 200
    # More than the whole minute never fits: a 422 naming the limit, not a 429.
    too_long = await client.post("/generate", json=tgi(60), headers=auth("sk-tpm"))
    assert too_long.status_code == 422 and "tokens_per_minute" in too_long.json()["error"]


async def test_an_early_stop_gives_its_reserved_tokens_back(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    # sk-refund has 150 a minute; each request reserves 1 + 100.
    fake.eos_after = 2
    done = await client.post("/generate", json=tgi(100, details=True), headers=auth("sk-refund"))
    assert done.json()["details"]["finish_reason"] == "eos_token"
    assert (
        await client.post("/generate", json=tgi(100), headers=auth("sk-refund"))
    ).status_code == 200
    fake.eos_after = None
    fake.step_delay_s = 0.02
    # A client that leaves mid-stream pays for the tokens generated until then.
    async with client.stream(
        "POST", "/generate_stream", json=tgi(100), headers=auth("sk-refund")
    ) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass
    fake.step_delay_s = 0.0
    for _ in range(100):  # until the router has seen the disconnect and settled
        answer = await client.post("/generate", json=tgi(100), headers=auth("sk-refund"))
        if answer.status_code == 200:
            break
        await asyncio.sleep(0.02)
    assert answer.status_code == 200, answer.json()


async def test_max_concurrent_counts_a_stream_until_its_end(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.02
    async with client.stream(
        "POST", "/generate_stream", json=tgi(20), headers=auth("sk-conc")
    ) as stream:
        assert stream.status_code == 200
        busy = await client.post("/generate", json=tgi(), headers=auth("sk-conc"))
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert "max_concurrent" in busy.json()["error"]
        assert (
            await client.post("/generate", json=tgi(), headers=auth("sk-open"))
        ).status_code == 200
        await stream.aread()
    assert (await client.post("/generate", json=tgi(), headers=auth("sk-conc"))).status_code == 200


async def test_a_max_new_tokens_limit_refuses_more_and_caps_the_default(
    client: httpx.AsyncClient,
) -> None:
    over = await client.post("/generate", json=tgi(6), headers=auth("sk-short"))
    assert over.status_code == 422 and over.json()["error_type"] == "validation"
    assert over.json()["error"] == (
        "`max_new_tokens` must be <= 5 for this API key (its `max_new_tokens` limit). Given: 6"
    )
    openai = await client.post(
        "/v1/chat/completions", json=chat(max_tokens=6), headers=auth("sk-short")
    )
    assert (
        openai.status_code == 422
        and "`max_tokens` must be <= 5" in openai.json()["error"]["message"]
    )
    defaulted = await client.post(
        "/generate", json=tgi(None, details=True), headers=auth("sk-short")
    )
    assert defaulted.json()["details"]["generated_tokens"] == 5
    assert (
        await client.post("/generate", json=tgi(5), headers=auth("sk-short"))
    ).status_code == 200


async def test_a_key_may_only_use_its_models(client: httpx.AsyncClient) -> None:
    base = await client.post("/generate", json=tgi(), headers=auth("sk-adapter"))
    assert base.status_code == 404
    assert base.json() == {
        "error": "The model `fake-model` does not exist or this API key may not use it",
        "error_type": "model_not_found",
    }
    sql = await client.post("/generate", json=tgi(adapter_id="sql"), headers=auth("sk-adapter"))
    assert sql.status_code == 200
    poet = await client.post(
        "/v1/chat/completions", json=chat(model="poet"), headers=auth("sk-adapter")
    )
    assert poet.status_code == 404 and poet.json()["error"]["code"] == "model_not_found"
    ok = await client.post(
        "/v1/chat/completions", json=chat(model="sql"), headers=auth("sk-adapter")
    )
    assert ok.status_code == 200
    anthropic = await client.post(
        "/v1/messages", json=message(), headers={"x-api-key": "sk-adapter"}
    )
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
    assert (await client.post("/generate", json=tgi(), headers=auth("sk-base"))).status_code == 200
    other = await client.post("/generate", json=tgi(adapter_id="sql"), headers=auth("sk-base"))
    assert other.status_code == 404


async def test_models_lists_what_the_key_may_use(client: httpx.AsyncClient) -> None:
    async def listed(headers: dict[str, str]) -> list[str]:
        response = await client.get("/v1/models", headers=headers)
        assert response.status_code == 200
        return [card["id"] for card in response.json()["data"]]

    everything = await listed({})  # the route is open: no key, every model
    assert "fake-model" in everything and {"sql", "poet"} <= set(everything)
    assert await listed(auth("sk-adapter")) == ["sql"]
    assert await listed(auth("sk-base")) == ["fake-model"]
    assert await listed(auth("sk-open")) == everything
    assert await listed(auth("sk-unknown")) == everything  # an unknown key filters nothing


async def test_sighup_reloads_the_keys_under_a_running_stream(
    client: httpx.AsyncClient, fake: FakeShard, keys_file: Path
) -> None:
    fake.step_delay_s = 0.02
    async with client.stream(
        "POST", "/generate_stream", json=tgi(30), headers=auth("sk-open")
    ) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass
        keys_file.write_text("keys:\n  - {key: sk-new, tenant: open}\n")
        # The router handles SIGHUP (else the signal would end the test process).
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            answer = await client.post("/generate", json=tgi(1), headers=auth("sk-new"))
            if answer.status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert answer.status_code == 200
        rest = [line async for line in lines if line.startswith("data:")]
    final = json.loads(rest[-1].removeprefix("data:"))
    assert final["generated_text"] is not None and len(rest) == 30 - 1
    assert (await client.post("/generate", json=tgi(1), headers=auth("sk-open"))).status_code == 401
    # A bad file keeps the keys in force.
    keys_file.write_text("keys: [")
    os.kill(os.getpid(), signal.SIGHUP)
    await asyncio.sleep(0.1)
    assert (await client.post("/generate", json=tgi(1), headers=auth("sk-new"))).status_code == 200


def metric(text: str, line_start: str) -> float:
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(line_start)]
    return float(value)


async def test_metrics_and_the_access_log_show_each_tenant(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="textgate.router.access")
    for _ in range(3):
        await client.post("/generate", json=tgi(4), headers=auth("sk-rpm"))
    await client.post("/generate", json=tgi(30), headers=auth("sk-tpm"))
    await client.post("/generate", json=tgi(30), headers=auth("sk-tpm"))
    text = (await client.get("/metrics")).text
    assert metric(text, 'textgate_tenant_request_count{tenant="rpm"}') == 3
    assert metric(text, 'textgate_tenant_generated_tokens{tenant="rpm"}') == 8
    assert metric(text, 'textgate_tenant_generated_tokens{tenant="tpm"}') == 30
    limited = 'textgate_tenant_rate_limited{limit="{}",tenant="{}"}'
    assert metric(text, limited.replace("{}", "requests_per_minute", 1).replace("{}", "rpm")) == 1
    assert metric(text, limited.replace("{}", "tokens_per_minute", 1).replace("{}", "tpm")) == 1
    records = [r for r in caplog.records if r.name == "textgate.router.access"]
    tenants = [r.request["tenant"] for r in records if r.request["path"] == "/generate"]  # type: ignore[attr-defined]
    assert tenants == ["rpm"] * 3 + ["tpm"] * 2
    assert "tenant=rpm" in records[0].getMessage()


async def serial_router(start_router: StartRouter, keys_file: Path, fake: FakeShard) -> str:
    """A router that runs one request at a time over slow steps: the others queue."""
    fake.step_delay_s = 0.02
    return await start_router(ChatFakeTokenizer(), api_keys_file=str(keys_file), max_batch_size=1)


async def test_priority_is_bounded_by_the_key_and_a_better_one_is_served_first(
    start_router: StartRouter, keys_file: Path, fake: FakeShard
) -> None:
    url = await serial_router(start_router, keys_file, fake)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        over = await client.post("/generate", json=tgi(priority=0), headers=auth("sk-low"))
        assert over.status_code == 422 and over.json()["error"] == (
            "`priority` must be >= 1 for this API key (its `priority` limit; lower is served "
            "first). Given: 0"
        )
        openai = await client.post(
            "/v1/chat/completions", json=chat(priority=0), headers=auth("sk-low")
        )
        assert openai.status_code == 422 and "`priority` must be >= 1" in openai.text
        # Unset, a request takes its key's bound.
        assert (await client.post("/generate", json=tgi(), headers=auth("sk-low"))).is_success
        done: list[str] = []

        async def post(name: str, path: str, body: dict[str, Any], key: str) -> None:
            answer = await client.post(path, json=body, headers=auth(key))
            assert answer.status_code == 200, answer.text
            done.append(name)

        tasks = [asyncio.create_task(post("long", "/generate", tgi(15), "sk-open"))]
        await asyncio.sleep(0.1)
        for name in ("low1", "low2", "low3"):
            tasks.append(asyncio.create_task(post(name, "/generate", tgi(priority=5), "sk-low")))
            await asyncio.sleep(0.03)
        best = chat(max_tokens=3, priority=1)
        tasks.append(asyncio.create_task(post("best", "/v1/chat/completions", best, "sk-low")))
        await asyncio.gather(*tasks)
    assert done == ["long", "best", "low1", "low2", "low3"]


async def test_a_deadline_passed_in_the_queue_is_408_in_each_shape(
    start_router: StartRouter, keys_file: Path, fake: FakeShard
) -> None:
    url = await serial_router(start_router, keys_file, fake)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        zero = await client.post("/generate", json=tgi(timeout=0), headers=auth("sk-open"))
        assert zero.status_code == 422
        assert zero.json()["error"] == "`timeout` must be > 0 seconds. Given: 0.0"
        long = asyncio.create_task(client.post("/generate", json=tgi(40), headers=auth("sk-open")))
        await asyncio.sleep(0.1)
        quick = {"X-Request-Timeout": "0.2"}
        tgi_answer, openai, anthropic, stream, patient, bad = await asyncio.gather(
            client.post("/generate", json=tgi(timeout=0.2), headers=auth("sk-open")),
            client.post("/v1/chat/completions", json=chat(), headers=auth("sk-open") | quick),
            # The key's `timeout_s` (0.25) when the request gives none.
            client.post("/v1/messages", json=message(), headers={"x-api-key": "sk-hurry"}),
            client.post("/generate_stream", json=tgi(timeout=0.2), headers=auth("sk-open")),
            # The body's timeout wins over the header's.
            client.post("/generate", json=tgi(timeout=30.0), headers=auth("sk-open") | quick),
            client.post(
                "/generate", json=tgi(), headers=auth("sk-open") | {"x-request-timeout": "soon"}
            ),
        )
        assert (await long).status_code == 200
    message_text = "Request timed out: its deadline passed while it waited in the queue"
    assert tgi_answer.status_code == 408
    assert tgi_answer.json() == {"error": message_text, "error_type": "timeout"}
    assert openai.status_code == 408
    assert openai.json()["error"] == {
        "message": message_text,
        "type": "timeout_error",
        "param": None,
        "code": "request_timeout",
    }
    assert anthropic.status_code == 408
    assert anthropic.json()["error"] == {"type": "timeout_error", "message": message_text}
    assert stream.status_code == 200
    assert json.loads(stream.text.strip().removeprefix("data:")) == {
        "error": message_text,
        "error_type": "timeout",
    }
    assert patient.status_code == 200
    assert bad.status_code == 422
    assert bad.json()["error"] == "`X-Request-Timeout` must be a number of seconds. Given: soon"


async def test_a_light_tenant_is_not_starved_behind_a_heavy_tenants_backlog(
    start_router: StartRouter, tmp_path: Path, fake: FakeShard
) -> None:
    keys = tmp_path / "fair.yaml"
    keys.write_text("keys:\n  - {key: sk-heavy, tenant: heavy}\n  - {key: sk-light, tenant: light}")
    url = await serial_router(start_router, keys, fake)
    done: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:

        async def post(name: str, key: str) -> None:
            answer = await client.post("/generate", json=tgi(3), headers=auth(key))
            assert answer.status_code == 200, answer.text
            done.append(name)

        heavy = [asyncio.create_task(post(f"heavy{i}", "sk-heavy")) for i in range(8)]
        # All of the heavy tenant's requests queue (one runs) before the light one's.
        while metric((await client.get("/metrics")).text, "tgi_queue_size") < 7:
            await asyncio.sleep(0.01)
        light = [asyncio.create_task(post(f"light{i}", "sk-light")) for i in range(2)]
        await asyncio.gather(*heavy, *light)
    # First come, first served ends them last (9th and 10th); by fair shares they alternate
    # with the heavy tenant's (measured: heavy, light, heavy, light, heavy, ...).
    assert {"light0", "light1"} <= set(done[:5]), done
