"""Reading a request's channel in the engine tests: all its events, or a condition in time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from textgate.router.engine.channel import Channel, Event


async def events_of(channel: Channel, timeout: float = 5.0) -> list[Event]:
    async def drain() -> list[Event]:
        return [event async for event in channel]

    return await asyncio.wait_for(drain(), timeout)


async def eventually(condition: Callable[[], object], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")
