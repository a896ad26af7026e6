"""What every route handler shares: config, tokenizer, validator, engine, shards, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textgate.proto import generate_pb2 as pb
from textgate.router.config import RouterConfig
from textgate.router.engine.factory import Engine
from textgate.router.generation.validation import Tokenizer, Validator
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient


@dataclass(frozen=True)
class RouterState:
    """Built once by `build_app`; route modules (TGI, OpenAI) take it explicitly."""

    config: RouterConfig
    shards: ShardedClient
    tokenizer: Tokenizer
    validator: Validator
    engine: Engine
    shard_info: pb.InfoResponse | None
    metrics: Metrics = field(default_factory=Metrics)
    """The app's Prometheus metrics: handlers record `request_*`, the engine `batch_*`."""
    autoconfig: dict[str, Any] | None = None
    """The startup report (`router/autoconfig.py`) /info shows; None without measurements."""
