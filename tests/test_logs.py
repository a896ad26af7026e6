"""Every process logs in one format: text with its name, or one JSON object per line."""

from __future__ import annotations

import json
import logging

import pytest

from textgate.launcher import main as launcher_main
from textgate.logs import JsonFormatter, level_from_env, setup_logging


def record(message: str, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("textgate.shard", logging.INFO, __file__, 1, message, (), None)
    made.__dict__.update(extra)
    return made


def test_json_lines_escape_any_message_and_name_the_process() -> None:
    line = JsonFormatter("shard-1").format(record('quotes " and \n newlines'))
    parsed = json.loads(line)
    assert "\n" not in line
    assert parsed["message"] == 'quotes " and \n newlines'
    assert (parsed["process"], parsed["target"], parsed["level"]) == (
        "shard-1",
        "textgate.shard",
        "INFO",
    )
    assert "request" not in parsed


def test_json_lines_carry_an_access_log_request() -> None:
    parsed = json.loads(JsonFormatter("router").format(record("POST /", request={"status": 200})))
    assert parsed["request"] == {"status": 200}


@pytest.mark.parametrize("json_output", [False, True])
def test_setup_logging_writes_one_shape(
    json_output: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(json_output, "launcher")
        logging.getLogger("textgate.launcher").info("Args %s", "{}")
        line = capsys.readouterr().err.strip()
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    if json_output:
        assert json.loads(line)["message"] == "Args {}"
    else:
        assert line.endswith(" INFO [launcher] textgate.launcher: Args {}")


@pytest.mark.parametrize(
    ("value", "level"),
    [("", logging.INFO), ("debug", logging.DEBUG), (" WARNING ", logging.WARNING),
     ("error", logging.ERROR)],
)  # fmt: skip
def test_log_level_comes_from_tgis_env_var(
    value: str, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOG_LEVEL", value)
    assert level_from_env() == level
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(False, "router")
        assert root.level == level
    finally:
        root.handlers[:], old = saved
        root.setLevel(old)


def test_an_unknown_log_level_is_refused_naming_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="LOG_LEVEL='chatty': expected one of debug, error"):
        level_from_env()
    with pytest.raises(SystemExit, match="textgate-launcher: error: LOG_LEVEL='chatty'"):
        launcher_main(["--port", "1"])
