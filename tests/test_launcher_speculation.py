"""--speculate, --speculative-ngram and --speculative-model: checked by the launcher, carried
to the router's config and from there to the scheduler's; the draft model's folder and
quantization to the shards' command line."""

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
        (["--speculative-model", "embedded"], "--speculative-model needs --speculate N"),
        (
            ["--speculative-model", "embedded", "--speculate", "4", "--num-shard", "2"],
            "--speculative-model runs on one shard",
        ),
        (["--speculative-quantize", "int8"], "--speculative-quantize needs --speculative-model"),
    ],
)
def test_bad_values_exit_with_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(argv, env={})
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_draft_model_reaches_the_shards_and_the_router(tiny_model_dir: Path) -> None:
    argv = ["--speculate", "4", "--speculative-model", str(tiny_model_dir)]
    config = launcher.parse_args([*argv, "--speculative-quantize", "int8"], env={})
    draft = launcher.draft_model_path(config)
    assert draft == tiny_model_dir
    shard = launcher.shard_argv(tiny_model_dir, config, draft)
    at = shard.index("--speculative-model-path")
    assert shard[at + 1 : at + 4] == [str(tiny_model_dir), "--speculative-quantize", "int8"]
    router = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, config)))
    assert speculation_config(router) == SpeculationConfig(4, 1, 3, draft_model=True)
    plain = launcher.parse_args([], env={})
    assert launcher.draft_model_path(plain) is None
    assert "--speculative-model-path" not in launcher.shard_argv(tiny_model_dir, plain)
