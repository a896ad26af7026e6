"""Router fixtures: fake shards on a unix socket, a ShardedClient, the app served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from textgate.router.config import RouterConfig
from textgate.router.generation.reasoning import PARSERS, ReasoningParser
from textgate.router.server import bound_port, build_router
from textgate.router.shard_client import ShardedClient
from textgate.tests.router.fake_shard import FakeShard, FakeTokenizer, fake_shards

TEST_LIMITS: dict[str, Any] = {
    "max_input_tokens": 64,
    "max_total_tokens": 128,
    "max_batch_prefill_tokens": 256,
}


@pytest.fixture
def uds_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Unix socket paths must stay short (~100 bytes): a fresh short temp dir.
    return str(tmp_path_factory.mktemp("uds") / "s")


@pytest.fixture
async def fake(uds_path: str) -> AsyncIterator[FakeShard]:
    """Rank 0 of a one-shard fake model."""
    async with fake_shards(uds_path) as shards:
        yield shards[0]


@pytest.fixture
async def sharded(fake: FakeShard, uds_path: str) -> AsyncIterator[ShardedClient]:
    client = await ShardedClient.connect(uds_path, timeout_s=5)
    yield client
    await client.close()


@pytest.fixture
def make_config(uds_path: str) -> Callable[..., RouterConfig]:
    """RouterConfig for tests: small token limits, the fake shard's socket."""

    def make(**overrides: Any) -> RouterConfig:
        fields = {
            "model_id": "fake-model",
            "tokenizer_path": "unused",
            "shard_uds_path": uds_path,
            **TEST_LIMITS,
            **overrides,
        }
        return RouterConfig(**fields)

    return make


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers (pytest owns the process's signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@pytest.fixture
async def start_router(
    sharded: ShardedClient, make_config: Callable[..., RouterConfig]
) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """`await start_router(tokenizer=None, clock=time.monotonic, **config_overrides)` serves
    the app on a free port (FakeTokenizer by default; `clock` times the tenants' quotas);
    gives its URL."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(
        tokenizer: FakeTokenizer | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ) -> str:
        config = make_config(**overrides)
        app = await build_router(config, sharded, tokenizer or FakeTokenizer(), clock=clock)
        server = _QuietServer(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, ws="none", lifespan="on")
        )
        task = asyncio.create_task(server.serve())
        servers.append((server, task))
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{bound_port(server, 0)}"

    yield start
    for server, task in servers:
        server.should_exit = True
        await task


@pytest.fixture
async def router(
    start_router: Callable[..., Awaitable[str]],
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for a router with the test config."""
    base_url = await start_router()
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        yield client


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A real tokenizer folder (word level, "wN" -> N) AutoTokenizer can load."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 300)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def toy_reasoning(monkeypatch: pytest.MonkeyPatch) -> str:
    """A reasoning parser, "toy", for the fake model's text: it begins inside the
    thinking and " t12" ends it, so " t10 t11 t12 t13 t14" thinks " t10 t11" (three
    tokens with the closing one) and answers "t13 t14"."""
    monkeypatch.setitem(PARSERS, "toy", ReasoningParser("toy", starts_inside=True, end=" t12"))
    return "toy"
