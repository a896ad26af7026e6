"""Launcher: TGI flag names, env-var fallbacks, limits, and supervision of its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from textgate import launcher


def test_flags_have_tgi_names_and_env_fallbacks() -> None:
    config = launcher.parse_args(
        ["--model-id", "/m", "--max-total-tokens", "512", "--port", "9000"],
        env={"MAX_INPUT_TOKENS": "100", "PORT": "1", "JSON_OUTPUT": "true"},
    )
    assert config.model_id == "/m" and config.max_total_tokens == 512
    assert config.port == 9000, "a flag wins over its env var"
    assert config.max_input_tokens == 100 and config.json_output is True


def test_tgi_legacy_and_list_flags() -> None:
    config = launcher.parse_args(
        ["--max-input-length", "10", "--cors-allow-origin", "http://a, http://b"], env={}
    )
    assert config.max_input_tokens == 10
    assert config.cors_allow_origin == ("http://a", "http://b")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-shard", "0"], "--num-shard must be at least 1"),
        (["--max-input-tokens", "10", "--max-total-tokens", "10"], "must be smaller"),
        (["--quantize", "eetq"], "--quantize eetq is TGI's, but not supported by textgate"),
        (["--quantize", "int4"], "--quantize int4 is unknown; use one of: awq, gptq"),
        (["--no-adaptive", "--target-itl-ms", "50"], "contradicts"),
        (["--target-itl-ms", "-1"], "--target-itl-ms must be >= 0"),
        (["--dtype", "float8"], "invalid choice"),
    ],
)
def test_bad_flags_exit_with_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(argv, env={})
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_quantize_is_passed_to_every_shard() -> None:
    for method in launcher.QUANTIZE_METHODS:
        config = launcher.parse_args(["--quantize", method], env={})
        argv = launcher.shard_argv(Path("/m"), config)
        assert argv[argv.index("--quantize") + 1] == method
    assert launcher.parse_args([], env={"QUANTIZE": "int8"}).quantize == "int8"
    assert "--quantize" not in launcher.shard_argv(Path("/m"), launcher.parse_args([], env={}))


def test_quantize_methods_are_the_shards_registered_loaders() -> None:
    from textgate.quantization import registered_methods

    # Every loader the shards register is reachable from the flag, and the flag offers
    # nothing without a loader (GPTQ/AWQ land with their loaders).
    served = set(registered_methods()) - {"unquantized"}
    assert served <= set(launcher.QUANTIZE_METHODS)
    assert set(launcher.QUANTIZE_METHODS) - served <= {"gptq", "awq"}


def test_limits_default_like_tgi(tiny_model_dir: Path) -> None:
    config = launcher.parse_args([], env={})
    limits = launcher.model_limits(tiny_model_dir, config)
    # The tiny model supports 512 positions.
    assert limits == {
        "max_total_tokens": 512,
        "max_input_tokens": 511,
        # Left to the router, which knows whether the shards are paged and on the CPU.
        "max_batch_prefill_tokens": None,
    }
    settings = launcher.router_config(tiny_model_dir, config)
    assert settings["tokenizer_path"] == str(tiny_model_dir)
    assert settings["max_concurrent_requests"] == 128


def _start(tmp_path: Path, model: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "textgate.launcher", "--model-id", str(model)]
    argv += ["--port", str(launcher.free_port()), "--shard-uds-path", str(tmp_path / "s")]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)


def _shard_pid(tmp_path: Path) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if Path(f"{tmp_path / 's'}-0").exists():
            found = subprocess.run(
                ["pgrep", "-f", f"textgate.shard_server.*{tmp_path / 's'}"],
                capture_output=True,
                text=True,
            ).stdout.split()
            if found:
                return int(found[0])
        time.sleep(0.2)
    raise TimeoutError("shard socket never appeared")


def test_killed_shard_stops_the_launcher_with_a_clear_message(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    process = _start(tmp_path, tiny_model_dir)
    try:
        os.kill(_shard_pid(tmp_path), signal.SIGKILL)
        started = time.monotonic()
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0
    assert time.monotonic() - started < 15
    assert "shard 0 exited with code -9" in stderr


def test_sigterm_stops_everything_cleanly(tmp_path: Path, tiny_model_dir: Path) -> None:
    process = _start(tmp_path, tiny_model_dir)
    try:
        shard = _shard_pid(tmp_path)
        time.sleep(1)
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(shard, 0)


def test_reasoning_parsers_are_the_routers() -> None:
    from textgate.launcher_flags import REASONING_PARSERS
    from textgate.router.generation.reasoning import PARSERS

    assert sorted(REASONING_PARSERS) == PARSERS.names()
    config = launcher.parse_args(["--reasoning-parser", "qwen3"], env={})
    assert config.reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        launcher.parse_args(["--reasoning-parser", "nope"], env={})


def test_readme_documents_every_flag() -> None:
    readme = (Path(launcher.__file__).parent / "README.md").read_text()
    for flag in launcher.FLAGS:
        assert f"`--{flag.name}`" in readme, f"README lacks --{flag.name}"


def test_router_config_round_trips_into_the_router(tiny_model_dir: Path) -> None:
    import json

    from textgate.router.config import RouterConfig

    config = launcher.parse_args(["--prefix-caching", "false", "--target-itl-ms", "80"], env={})
    router = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, config)))
    assert router.prefix_caching is False and router.target_itl_ms == 80
    fixed = launcher.parse_args(["--no-adaptive"], env={})
    assert launcher.router_config(tiny_model_dir, fixed)["target_itl_ms"] == 0
    default = launcher.router_config(tiny_model_dir, launcher.parse_args([], env={}))
    assert default["target_itl_ms"] is None  # derived by the controller
    assert router.max_total_tokens == 512


def test_max_logit_bias_reaches_the_router_and_is_bounded(tiny_model_dir: Path) -> None:
    config = launcher.parse_args(["--max-logit-bias", "5"], env={})
    assert launcher.router_config(tiny_model_dir, config)["max_logit_bias"] == 5
    with pytest.raises((SystemExit, ValueError)):
        launcher.parse_args(["--max-logit-bias", "101"], env={})


def test_lora_adapters_take_tgis_syntax_and_reach_the_shard(tmp_path: Path) -> None:
    config = launcher.parse_args(["--lora-adapters", "sql=/a/sql, /b/poet/"], env={})
    assert config.lora_adapters == (("sql", "/a/sql"), ("poet", "/b/poet/"))
    argv = launcher.shard_argv(tmp_path, config)
    assert argv[argv.index("--lora-adapters") + 1] == "sql=/a/sql,poet=/b/poet/"
    from_env = launcher.parse_args([], env={"LORA_ADAPTERS": "x=/x"})
    assert from_env.lora_adapters == (("x", "/x"),)
    with pytest.raises(SystemExit):
        launcher.parse_args(["--lora-adapters", "a=/1,a=/2"], env={})


def test_lora_limits_reach_the_shard_and_are_checked(tmp_path: Path) -> None:
    config = launcher.parse_args(["--max-loras", "2", "--max-lora-rank", "16"], env={})
    argv = launcher.shard_argv(tmp_path, config)
    assert argv[argv.index("--max-loras") + 1 :][:3] == ["2", "--max-lora-rank", "16"]
    defaults = launcher.shard_argv(tmp_path, launcher.parse_args([], env={}))
    assert defaults[defaults.index("--max-loras") + 1] == "8"
    assert defaults[defaults.index("--max-lora-rank") + 1] == "64"
    assert "--max-cpu-loras" not in defaults  # the shard's default: 4 x --max-loras
    more = launcher.parse_args(["--max-loras", "1", "--lora-adapters", "a=/1,b=/2"], env={})
    argv = launcher.shard_argv(tmp_path, launcher.parse_args(["--max-cpu-loras", "9"], env={}))
    assert argv[argv.index("--max-cpu-loras") + 1] == "9" and len(more.lora_adapters) == 2
    for argv in (
        ["--max-loras", "0"],
        ["--lora-adapters", "a=/1,b=/2", "--max-loras", "1", "--max-cpu-loras", "1"],
        ["--max-loras", "2", "--max-cpu-loras", "1"],
    ):
        with pytest.raises(SystemExit):
            launcher.parse_args(argv, env={})


def test_api_keys_file_is_read_before_the_model_and_reaches_the_router(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-a, tenant: a}\n")
    config = launcher.parse_args(["--api-keys-file", str(keys)], env={})
    assert launcher.router_config(tiny_model_dir, config)["api_keys_file"] == str(keys)
    keys.write_text("keys:\n  - {key: sk-a}\n")
    with pytest.raises(SystemExit):
        launcher.parse_args([], env={"API_KEYS_FILE": str(keys)})
    assert "keys.0.tenant: Field required" in capsys.readouterr().err


def test_the_audit_log_flags_reach_the_router(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from textgate.router.config import RouterConfig

    path = str(tmp_path / "audit.jsonl")
    argv = ["--audit-log", path, "--audit-log-content", "true", "--audit-log-max-bytes", "4096"]
    config = launcher.parse_args(argv, env={})
    router = RouterConfig.from_json(json.dumps(launcher.router_config(tiny_model_dir, config)))
    assert (router.audit_log, router.audit_log_content, router.audit_log_max_bytes) == (
        path,
        True,
        4096,
    )
    default = launcher.router_config(tiny_model_dir, launcher.parse_args([], env={}))
    assert default["audit_log"] is None and default["audit_log_max_bytes"] == 100 * 1024 * 1024
    with pytest.raises(ValueError, match="audit_log_max_bytes"):
        RouterConfig(model_id="m", tokenizer_path="t", audit_log_max_bytes=0)


def test_children_start_without_the_working_directory_on_their_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkout's `kernels/` folder must not shadow the PyPI `kernels` transformers imports.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("raise ImportError('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    argv = launcher.shard_argv(Path("/m"), launcher.parse_args([], env={}))
    probe = [*argv[: argv.index("textgate.shard_server") - 1], "-c", "import sys; print(sys.path)"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
    assert str(tmp_path) not in out and "''" not in out
    assert tuple(argv[:3]) == launcher.PYTHON_MODULE  # the router starts the same way
