"""engine.factory: how the router's flags become the paged scheduler's config."""

from __future__ import annotations

import pytest

from textgate.router.config import RouterConfig
from textgate.router.engine.factory import describe_controller, scheduler_config


def router_config(**overrides: object) -> RouterConfig:
    values: dict[str, object] = {
        "model_id": "m",
        "tokenizer_path": "t",
        "max_batch_prefill_tokens": 256,
        "max_waiting_tokens": 7,
    }
    values.update(overrides)
    return RouterConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("target_itl_ms", "adaptive", "target_itl_s", "described"),
    [
        (None, True, None, "adaptive, inter-token latency target derived from the first steps"),
        (80.0, True, 0.08, "adaptive, inter-token latency target 80.0 ms"),
        (0.0, False, None, "fixed budgets (256 tokens, 256 requests per step)"),
    ],
)
def test_target_itl_ms_picks_the_controller_mode(
    target_itl_ms: float | None, adaptive: bool, target_itl_s: float | None, described: str
) -> None:
    config = scheduler_config(router_config(target_itl_ms=target_itl_ms), 16, 100)
    assert (config.adaptive, config.target_itl_s) == (adaptive, target_itl_s)
    assert config.max_waiting_steps == 7
    assert describe_controller(config).startswith(described)
