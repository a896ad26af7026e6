"""What the tenancy e2e tests send: TGI requests with a key, timed streams, closed loops."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = (
    "Request {n}. Write a short story about a lighthouse keeper who finds a message in a "
    "bottle on the shore one stormy night, and what she decides to do about it."
)
"""Numbered first, so no two requests share a cached prefix: each one's prompt is served."""

NUMBERS = itertools.count()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tgi(max_new_tokens: int, **parameters: Any) -> dict[str, Any]:
    """A TGI body that generates exactly `max_new_tokens` (eos ignored), its own prompt."""
    parameters |= {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    return {"inputs": PROMPT.format(n=next(NUMBERS)), "parameters": parameters}


@dataclass
class Streamed:
    """One `/generate_stream` request: when it was sent, when each token came, its end."""

    status: int
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    final: dict[str, Any] | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at

    @property
    def succeeded(self) -> bool:
        return self.status == 200 and self.final is not None and "error" not in self.final


async def stream(
    client: httpx.AsyncClient,
    key: str,
    body: dict[str, Any],
    first: asyncio.Event | None = None,
    into: list[Streamed] | None = None,
) -> Streamed:
    """Stream `body` with `key`, timing each token; `first` is set at its first token;
    `into` gets the result as the request is sent (so a cancelled one still counts)."""
    result = Streamed(0, time.perf_counter())
    if into is not None:
        into.append(result)
    async with client.stream("POST", "/generate_stream", json=body, headers=auth(key)) as answer:
        result.status = answer.status_code
        async for line in answer.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line.removeprefix("data:"))
            if "token" in event:
                result.token_times.append(time.perf_counter())
                if first is not None:
                    first.set()
            if "error" in event or event.get("generated_text") is not None:
                result.final = event
    return result


async def closed_loop(
    client: httpx.AsyncClient,
    key: str,
    concurrency: int,
    max_new_tokens: int,
    into: list[Streamed],
    stop: asyncio.Event | None = None,
) -> None:
    """`concurrency` clients, each streaming one request after another into `into` until
    `stop` is set (or the task is cancelled)."""

    async def one_client() -> None:
        while stop is None or not stop.is_set():
            await stream(client, key, tgi(max_new_tokens), into=into)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))


def first_tokens_between(streams: list[Streamed], start: float, end: float) -> int:
    """How many of `streams` got their first token from `start` to `end` (inclusive)."""
    return sum(bool(s.token_times) and start <= s.token_times[0] <= end for s in streams)


def metric(text: str, name: str) -> float:
    """The value of the unlabelled series `name` in a Prometheus scrape."""
    (value,) = [line.split()[-1] for line in text.splitlines() if line.split(" ")[0] == name]
    return float(value)


def router_pids(launcher_pid: int) -> Iterator[int]:
    """The launcher's `python -m textgate.router` child (one)."""
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        if "textgate.router" in child.cmdline():
            yield child.pid
