"""--device-hour-cost: checked by the launcher, carried to the router's config and from
there to the engine's cost meter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from textgate import launcher
from textgate.router.config import RouterConfig


def test_the_flag_and_its_env_var_reach_the_routers_config(tiny_model_dir: Path) -> None:
    config = launcher.parse_args(["--device-hour-cost", "3.5"], env={})
    router = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, config)))
    assert router.device_hour_cost == 3.5
    env = launcher.parse_args([], env={"DEVICE_HOUR_COST": "0.25"})
    assert env.device_hour_cost == 0.25
    default = launcher.router_config(tiny_model_dir, launcher.parse_args([], env={}))
    assert RouterConfig.from_json(json.dumps(default)).device_hour_cost is None


@pytest.mark.parametrize("value", ["0", "-2", "inf", "nan"])
def test_a_price_that_is_no_price_exits_with_a_clear_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(["--device-hour-cost", value], env={})
    assert exit_info.value.code == 2
    assert "--device-hour-cost must be a number of USD > 0" in capsys.readouterr().err


def test_the_routers_config_refuses_it_too(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="device_hour_cost must be > 0"):
        RouterConfig(model_id="m", tokenizer_path=str(tiny_model_dir), device_hour_cost=0.0)
