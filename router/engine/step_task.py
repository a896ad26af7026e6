"""The one task that steps an engine's shards while there is work.

It reads::

    while open:
        wait until there is work     (a submit or a cancellation wakes it)
        step()                       (the engine's: schedule, run, route)
        on a bug: recover(exc)       (the engine fails what is in flight, so nothing hangs)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("textgate.router")

SHUTDOWN_MESSAGE = "Request failed during generation: the server is shutting down"


class StepTask:
    """Runs `step` while `has_work()`, sleeping until `wake()` otherwise; a step that raises
    is handed to `recover` and the task goes on."""

    def __init__(
        self,
        name: str,
        step: Callable[[], Awaitable[None]],
        has_work: Callable[[], bool],
        recover: Callable[[Exception], Awaitable[None]],
    ) -> None:
        self.name = name
        """Names the task (`textgate-<name>`) and its log lines."""
        self._step = step
        self._has_work = has_work
        self._recover = recover
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def wake(self) -> None:
        """There may be work: start the task, or end its sleep."""
        self._wakeup.set()
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._loop(), name=f"textgate-{self.name}")

    async def wait_for_wake(self, timeout_s: float) -> None:
        """Sleep until the next `wake()` or `timeout_s`, whichever comes first."""
        self._wakeup.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout=timeout_s)

    async def close(self) -> None:
        """Stop stepping (a step under way is cancelled)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while not self._closed:
            if not self._has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._step()
            except Exception as exc:
                # A bug must not leave requests hanging.
                log.exception("%s step failed", self.name)
                await self._recover(exc)
