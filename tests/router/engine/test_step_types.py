"""SchedulerConfig: validation of its limits, and that it is frozen."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest

from textgate.tests.router.engine.scheduler_helpers import make_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be at least 1"),
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ({"num_reserved_tokens": -1}, "num_reserved_tokens"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "at least max_num_seqs"),
        ({"target_itl_s": 0.0}, "target_itl_s"),
        ({"min_prefill_tokens": 0}, "min_prefill_tokens"),
        ({"max_waiting_steps": -1}, "max_waiting_steps"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_config_is_frozen() -> None:
    config, name = make_config(), "num_blocks"
    with pytest.raises(FrozenInstanceError):
        setattr(config, name, 3)


def test_controller_config_keeps_the_prefill_floor_within_the_step() -> None:
    config = make_config(max_num_batched_tokens=24, min_prefill_tokens=32, adaptive=True)
    controller = config.controller_config()
    assert controller.min_prefill_tokens == 24 and controller.max_prefill_tokens == 24
    assert controller.max_batch_size == config.max_num_seqs and controller.adaptive
