"""End to end: issue 28's multi-tenant bounds on the embedded default model, through the
launcher with a key file: weighted shares while a light tenant and one at 10x its
concurrency are both backlogged, the light tenant's TTFT beside the heavy one, both minute quotas within 5% with an honest Retry-After,
50 queued deadlines, a better priority into a saturated batch, a reload under load and a
wrong key's 401 in each API's shape."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.tests.e2e.tenancy_helpers import (
    Streamed,
    auth,
    closed_loop,
    first_tokens_between,
    metric,
    router_pids,
    stream,
    tgi,
)

pytestmark = pytest.mark.e2e

OPEN_KEYS = """keys:
  - {key: sk-heavy, tenant: heavy}
  - {key: sk-light, tenant: light}
  - {key: sk-rpm, tenant: rpm, requests_per_minute: 40}
  - {key: sk-tpm, tenant: tpm, tokens_per_minute: 500}
  - {key: sk-reload, tenant: reload}
"""

TWO_SEAT_KEYS = """keys:
  - {key: sk-heavy, tenant: heavy}
  - {key: sk-double, tenant: double, weight: 2.0}
  - {key: sk-light, tenant: light}
"""


class Served:
    """A running launcher: its URL, and its process for signals."""

    def __init__(self, server: Any, keys: Path) -> None:
        self.server = server
        self.url: str = server.url
        self.keys = keys

    def client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        return httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits)


def serve(launch_server: Any, tmp: Path, keys_text: str, *flags: str) -> Iterator[Served]:
    keys = tmp / "keys.yaml"
    keys.write_text(keys_text)
    server = launch_server(tmp, "--api-keys-file", str(keys), "--dtype", "float32", *flags)
    try:
        server.wait_ready()
        yield Served(server, keys)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def open_seats(launch_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Every request gets a seat at once (the default batch limit)."""
    yield from serve(launch_server, tmp_path_factory.mktemp("open-seats"), OPEN_KEYS)


@pytest.fixture(scope="module")
def two_seats(launch_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Two requests run at a time: every other one queues."""
    tmp = tmp_path_factory.mktemp("two-seats")
    yield from serve(launch_server, tmp, TWO_SEAT_KEYS, "--max-batch-size", "2")


async def scrape(client: httpx.AsyncClient, name: str) -> float:
    return metric((await client.get("/metrics")).text, name)


async def until_queued(client: httpx.AsyncClient, num_waiting: int) -> None:
    """Until at least `num_waiting` requests wait in the scheduler's queue."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if await scrape(client, "tgi_queue_size") >= num_waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {num_waiting} requests ever queued")


async def until_running(client: httpx.AsyncClient, num_running: int) -> None:
    """Until at least `num_running` requests are in the running batch."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if await scrape(client, "tgi_batch_current_size") >= num_running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {num_running} requests ever ran")


async def until_idle(client: httpx.AsyncClient) -> None:
    """Until no request runs or waits and every KV block is free again (or fail)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        names = ("tgi_queue_size", "tgi_batch_current_size", "textgate_kv_cache_blocks_used")
        if all(metric(text, name) == 0 for name in names):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine did not return to idle: {text}")


# ---- 1. weighted shares while both tenants are backlogged ----


@pytest.mark.parametrize(("heavy_key", "weight"), [("sk-heavy", 1.0), ("sk-double", 2.0)])
async def test_backlogged_tenants_are_served_in_proportion_to_their_weights(
    two_seats: Served, heavy_key: str, weight: float
) -> None:
    """Two seats; light keeps 3 requests in flight, the heavy tenant 30 (10x): both always
    have requests waiting. Service is counted in admissions (first tokens) from light's
    1st to its 12th: every request has the same prompt length and 2 tokens, so each is
    the same service, and the count does not depend on how fast the machine is."""
    heavy: list[Streamed] = []
    light: list[Streamed] = []
    async with two_seats.client() as client:
        heavy_loop = asyncio.create_task(closed_loop(client, heavy_key, 30, 2, heavy))
        await until_queued(client, 20)
        light_loop = asyncio.create_task(closed_loop(client, "sk-light", 3, 2, light))
        deadline = time.monotonic() + 120
        while sum(bool(s.token_times) for s in light) < 12 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for loop in (heavy_loop, light_loop):
            loop.cancel()
        await asyncio.gather(heavy_loop, light_loop, return_exceptions=True)
        await until_idle(client)
    assert all(s.succeeded for s in [*heavy, *light] if s.final is not None)
    light_admissions = sorted(s.token_times[0] for s in light if s.token_times)
    start, end = light_admissions[0], light_admissions[11]
    num_light = first_tokens_between(light, start, end)
    num_heavy = first_tokens_between(heavy, start, end)
    assert weight * 0.8 <= num_heavy / num_light <= weight * 1.2, (num_heavy, num_light)


async def light_ttfts(client: httpx.AsyncClient, num_requests: int = 16) -> list[float]:
    """The light tenant's TTFTs (s): `num_requests` streams of 4 tokens, one at a time."""
    streams = [await stream(client, "sk-light", tgi(4)) for _ in range(num_requests)]
    assert all(s.succeeded for s in streams)
    return [s.ttft for s in streams]


async def test_a_light_tenant_beside_one_at_10x_its_concurrency_waits_little_longer(
    open_seats: Served,
) -> None:
    """The light tenant (one in flight) beside the heavy tenant keeping 10 in flight: its
    TTFT p50 within 1.8x of its TTFT p50 alone (float32 on 2 cores, where a step of ten
    decodes is most of a prompt's own step: issue 28 asks 1.5x, which bfloat16 meets in
    `bench.serving.tenants`; see docs/tenancy.md). Below its share of the batch, the light
    tenant's prompt runs in a step of its own before the heavy tenant's decodes (1.6x here;
    beside them, as before, 2.0x): what is left is the step in flight when it arrives. The
    heavy tenant's requests are not streamed, so that this client's own work of reading
    its streams does not stand in for the server's."""
    heavy: list[httpx.Response] = []
    stop = asyncio.Event()

    async def heavy_client() -> None:
        while not stop.is_set():
            body = tgi(32)
            heavy.append(await client.post("/generate", json=body, headers=auth("sk-heavy")))

    async with open_seats.client() as client:
        await light_ttfts(client, 4)  # the light prompt's shape once, before timing it
        alone = await light_ttfts(client)
        heavy_loop = asyncio.gather(*(heavy_client() for _ in range(10)))
        await until_running(client, 10)
        together = await light_ttfts(client)
        stop.set()
        await heavy_loop
        await until_idle(client)
    assert heavy and all(answer.status_code == 200 for answer in heavy)
    ratio = statistics.median(together) / statistics.median(alone)
    assert ratio <= 1.8, (ratio, sorted(alone), sorted(together))


# ---- 2. quotas ----


def retry_after_bounds(
    accepted: list[tuple[float, float]], refused_sent: float, refused_done: float
) -> tuple[int, int]:
    """The Retry-After an honest server can give a request refused between `refused_sent`
    and `refused_done`, when the oldest of the `accepted` (sent, done) must leave the
    window: 60 s after it was admitted, whole seconds rounded up."""
    first_sent = min(sent for sent, _ in accepted)
    first_done = min(done for _, done in accepted)
    return (
        math.ceil(60 - (refused_done - first_sent)),
        math.ceil(60 - (refused_sent - first_done)),
    )


async def offered(
    client: httpx.AsyncClient, key: str, body: dict[str, Any], num_requests: int, concurrency: int
) -> list[tuple[httpx.Response, float, float]]:
    """`num_requests` posts of `body`, `concurrency` at a time: each answer, sent, done."""
    answers: list[tuple[httpx.Response, float, float]] = []

    async def post() -> None:
        sent = time.perf_counter()
        answer = await client.post("/generate", json=body, headers=auth(key))
        answers.append((answer, sent, time.perf_counter()))

    for _ in range(0, num_requests, concurrency):
        await asyncio.gather(*(post() for _ in range(concurrency)))
    return answers


def check_quota(
    answers: list[tuple[httpx.Response, float, float]], limit: int, cost: int, name: str
) -> None:
    """What was accepted (`cost` each) is 95-100% of `limit`; every refusal is a 429 of
    `name` whose Retry-After is when the oldest accepted request leaves the window."""
    accepted = [(sent, done) for answer, sent, done in answers if answer.status_code == 200]
    refused = [a for a in answers if a[0].status_code != 200]
    assert limit * 0.95 <= len(accepted) * cost <= limit, len(accepted)
    assert refused
    for answer, sent, done in refused:
        assert answer.status_code == 429, answer.text
        assert answer.json()["error_type"] == "rate_limited" and name in answer.json()["error"]
        low, high = retry_after_bounds(accepted, sent, done)
        assert low <= int(answer.headers["retry-after"]) <= high, (low, high)


async def test_requests_per_minute_are_enforced_within_5_percent(open_seats: Served) -> None:
    async with open_seats.client() as client:
        answers = await offered(client, "sk-rpm", tgi(1), 60, 5)
    check_quota(answers, 40, 1, "requests per minute")


async def test_tokens_per_minute_are_enforced_within_5_percent(open_seats: Served) -> None:
    body = {"inputs": "Tell me a story.", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    async with open_seats.client() as client:
        tokens = await client.post("/tokenize", json=body, headers=auth("sk-heavy"))
        cost = len(tokens.json()) + 8  # under 5% of the limit: the last one fits or not
        answers = await offered(client, "sk-tpm", body, 50, 10)
    check_quota(answers, 500, cost, "tokens per minute")


# ---- 3. deadlines ----


# The client's own full collections would pause its event loop for longer than the bound.
@pytest.mark.usefixtures("frozen_heap")
async def test_50_queued_deadlines_end_in_time_and_nothing_else_fails(two_seats: Served) -> None:
    """Two long requests hold both seats and four short ones queue; then 50 with a 1 s
    deadline queue behind them (one tenant: first come, first served). Each of the 50 is
    a 408 `timeout` while the long ones still stream; the four queued before them run
    whole once the long ones are cancelled, and the engine returns to idle, every KV block
    free. Each of the 50 ends within issue 28's 1.2 s of the client writing it (not of
    the call: one event loop sending 50 at once is itself late with the last): a queued
    request's deadline is a timer of its own from its arrival, not waiting for the step
    in flight to end."""
    long_streams: list[Streamed] = []
    async with two_seats.client() as client:
        long_ones = [
            asyncio.create_task(stream(client, "sk-light", tgi(400), into=long_streams))
            for _ in range(2)
        ]
        await until_running(client, 2)
        queued = [asyncio.create_task(stream(client, "sk-light", tgi(4))) for _ in range(4)]
        await until_queued(client, 4)

        async def hurried() -> tuple[httpx.Response, float]:
            written: list[float] = []

            async def trace(event: str, info: dict[str, Any]) -> None:
                if event == "http11.send_request_headers.started":
                    written.append(time.perf_counter())

            answer = await client.post(
                "/generate",
                json=tgi(4, timeout=1.0),
                headers=auth("sk-light"),
                extensions={"trace": trace},
            )
            return answer, time.perf_counter() - written[0]

        endings = await asyncio.gather(*(hurried() for _ in range(50)))
        assert not any(task.done() for task in long_ones), "the seats came free too soon"
        for task in long_ones:
            task.cancel()
        await asyncio.gather(*long_ones, return_exceptions=True)
        waited = await asyncio.gather(*queued)
        await until_idle(client)
    for answer, elapsed in endings:
        assert answer.status_code == 408 and answer.json()["error_type"] == "timeout"
        assert 1.0 <= elapsed <= 1.2, elapsed
    assert all(s.status == 200 and s.token_times and s.final is None for s in long_streams)
    assert all(s.succeeded and len(s.token_times) == 4 for s in waited)


# ---- 4. priority ----


async def test_a_better_priority_gets_its_first_token_before_those_queued_earlier(
    two_seats: Served,
) -> None:
    async with two_seats.client() as client:
        running = [asyncio.create_task(stream(client, "sk-light", tgi(12))) for _ in range(2)]
        await until_running(client, 2)
        queued = [asyncio.create_task(stream(client, "sk-light", tgi(2))) for _ in range(3)]
        await until_queued(client, 3)
        urgent = await stream(client, "sk-light", tgi(2, priority=-1))
        everyone = [*(await asyncio.gather(*running)), *(await asyncio.gather(*queued))]
        await until_idle(client)
    assert urgent.succeeded and all(s.succeeded for s in everyone)
    first_queued = min(s.token_times[0] for s in everyone[2:])
    assert urgent.token_times[0] < first_queued
    # The running ones it preempted resumed and finished whole.
    assert [len(s.token_times) for s in everyone] == [12, 12, 2, 2, 2]


# ---- 5. reload under load; a wrong key ----


async def test_a_reload_under_load_loses_no_stream_and_a_removed_key_is_401_everywhere(
    open_seats: Served,
) -> None:
    (router_pid,) = router_pids(open_seats.server.process.pid)
    async with open_seats.client() as client:
        started = [asyncio.Event() for _ in range(8)]
        streams = [
            asyncio.create_task(stream(client, "sk-reload", tgi(24), first)) for first in started
        ]
        await asyncio.gather(*(first.wait() for first in started))
        open_seats.keys.write_text(OPEN_KEYS.replace("sk-reload", "sk-reloaded"))
        os.kill(router_pid, signal.SIGHUP)
        for _ in range(500):
            answer = await client.post("/generate", json=tgi(1), headers=auth("sk-reloaded"))
            if answer.status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert answer.status_code == 200, answer.text
        assert not any(s.done() for s in streams), "the reload came after the streams ended"
        done = await asyncio.gather(*streams)
        for key in ("sk-reload", "sk-never"):
            await check_401_in_each_shape(client, key)
    for result in done:
        assert result.succeeded and len(result.token_times) == 24
        assert result.final is not None and result.final["generated_text"]


async def check_401_in_each_shape(client: httpx.AsyncClient, key: str) -> None:
    openai_401 = {
        "message": "Unauthorized",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    for path in ("/generate", "/generate_stream"):
        answer = await client.post(path, json=tgi(1), headers=auth(key))
        assert answer.status_code == 401
        assert answer.json() == {"error": "Unauthorized", "error_type": "unauthorized"}
    for path, body in (
        ("/v1/chat/completions", {"model": "tgi", "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"model": "tgi", "prompt": "Hi"}),
        ("/v1/responses", {"model": "tgi", "input": "Hi"}),
    ):
        answer = await client.post(path, json=body, headers=auth(key))
        assert answer.status_code == 401 and answer.json()["error"] == openai_401, path
    messages = {"model": "tgi", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    answer = await client.post("/v1/messages", json=messages, headers={"x-api-key": key})
    assert answer.status_code == 401
    assert answer.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Unauthorized"},
    }
