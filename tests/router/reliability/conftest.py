"""A router served from its own thread and event loop, for tests that drive it with
blocking clients (schemathesis' `case.call`, plain sockets, many httpx threads).

The fake shard, the engine and uvicorn all run on the thread's loop; the test talks to
them over loopback HTTP only, as a real client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn

from textgate.router.config import RouterConfig
from textgate.router.server import bound_port, build_router
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard, FakeTokenizer, fake_shards


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers (pytest owns the process's signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class ThreadedRouter:
    """A running router: its URL, its fake shard (tweak it through `call_soon`) and engine."""

    url: str
    shard: FakeShard
    engine: Any
    loop: asyncio.AbstractEventLoop

    def call_soon(self, action: Callable[[], object]) -> None:
        """Run `action` on the router's loop (the fake shard is not thread-safe)."""
        done = threading.Event()

        def run() -> None:
            try:
                action()
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(5), "the router's loop did not run the action within 5 s"


@contextlib.contextmanager
def threaded_router(
    uds_path: str,
    config: RouterConfig,
    *,
    step_delay_s: float = 0.0,
    uvicorn_options: dict[str, Any] | None = None,
    tokenizer: Any = None,
) -> Iterator[ThreadedRouter]:
    """Serve the router over a paged fake shard taking `step_delay_s` per step, in a thread
    (with `tokenizer`, FakeTokenizer by default)."""
    ready = threading.Event()
    started: list[ThreadedRouter] = []
    errors: list[BaseException] = []
    servers: list[uvicorn.Server] = []

    async def serve() -> None:
        async with fake_shards(uds_path) as (shard, *_):
            shard.step_delay_s = step_delay_s
            shards = await ShardedClient.connect(uds_path, timeout_s=5)
            app = await build_router(config, shards, tokenizer or FakeTokenizer())
            options = {"log_config": None, "ws": "none", "lifespan": "on"}
            options.update({"timeout_graceful_shutdown": 2, **(uvicorn_options or {})})
            server = _QuietServer(uvicorn.Config(app, host="127.0.0.1", port=0, **options))
            servers.append(server)
            task = asyncio.create_task(server.serve())
            try:
                while not server.started:
                    if task.done():
                        task.result()
                    await asyncio.sleep(0.01)
                url = f"http://127.0.0.1:{bound_port(server, 0)}"
                loop = asyncio.get_running_loop()
                started.append(ThreadedRouter(url, shard, app.state.engine, loop))
                ready.set()
                await task
            finally:
                await shards.close()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="router", daemon=True)
    thread.start()
    ready.wait(30)
    try:
        if errors:
            raise errors[0]
        assert started, "the router did not start within 30 s"
        yield started[0]
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "the router did not stop within 10 s"
        if errors:
            raise errors[0]


@pytest.fixture
def serve_in_thread(
    uds_path: str, make_config: Callable[..., RouterConfig]
) -> Callable[..., contextlib.AbstractContextManager[ThreadedRouter]]:
    """`with serve_in_thread(step_delay_s=..., uvicorn_options=..., tokenizer=...,
    **config) as router:`"""

    def start(
        step_delay_s: float = 0.0,
        uvicorn_options: dict[str, Any] | None = None,
        tokenizer: Any = None,
        **overrides: Any,
    ) -> contextlib.AbstractContextManager[ThreadedRouter]:
        config = make_config(**overrides)
        return threaded_router(
            uds_path,
            config,
            step_delay_s=step_delay_s,
            uvicorn_options=uvicorn_options,
            tokenizer=tokenizer,
        )

    return start
