"""--speculate and --speculative-ngram: checked by the launcher, carried to the router's
config and from there to the scheduler's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from textgate import launcher
from textgate.router.config import RouterConfig
from textgate.router.engine.factory import speculation_config
from textgate.router.engine.speculation import SpeculationConfig


def test_the_flags_reach_the_schedulers_speculation(tiny_model_dir: Path) -> None:
    config = launcher.parse_args(["--speculate", "5", "--speculative-ngram", "2:4"], env={})
    router = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, config)))
    assert (router.speculate, router.speculative_ngram) == (5, "2:4")
    assert speculation_config(router) == SpeculationConfig(5, 2, 4)
    env = launcher.parse_args([], env={"SPECULATE": "3", "SPECULATIVE_NGRAM": "2"})
    assert (env.speculate, env.speculative_ngram) == (3, "2")
    default = launcher.router_config(tiny_model_dir, launcher.parse_args([], env={}))
    assert speculation_config(RouterConfig.from_json(json.dumps(default))) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculate", "-1"], "--speculate must be >= 0"),
        (["--speculative-ngram", "3:1"], "--speculative-ngram needs 1 <= MIN <= MAX"),
        (["--speculative-ngram", "0:2"], "--speculative-ngram needs 1 <= MIN <= MAX"),
        (["--speculative-ngram", "a:b"], "--speculative-ngram must be MIN:MAX"),
    ],
)
def test_bad_values_exit_with_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(argv, env={})
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
