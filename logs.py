"""One log format for every textgate process (launcher, shards, router).

Text: `2026-12-01 02:53:18,961 INFO [shard-0] textgate.shard: message`. With
`--json-output`, one JSON object per line: timestamp, level, process, target (the logger),
message, and the access log's `request` fields when a record carries them. The launcher
passes `--json-output` on to the processes it starts, so a log collector reads one shape.
The `LOG_LEVEL` environment variable (TGI's: `debug`, `info`, `warning`, `error`; the
children inherit it) sets the level of every process; `info` when unset.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "warn": logging.WARNING, "error": logging.ERROR}  # fmt: skip
"""`LOG_LEVEL`'s values."""


def level_from_env(default: int = logging.INFO) -> int:
    """The level `LOG_LEVEL` names (case-insensitive), `default` when unset or empty;
    ValueError naming the accepted values for anything else."""
    name = os.environ.get("LOG_LEVEL", "").strip().lower()
    if not name:
        return default
    if name not in LEVELS:
        raise ValueError(f"LOG_LEVEL={name!r}: expected one of {', '.join(sorted(LEVELS))}")
    return LEVELS[name]


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "process": self._process,
            "target": record.name,
            "message": record.getMessage(),
        }
        request = getattr(record, "request", None)
        if isinstance(request, dict):
            line["request"] = request
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(json_output: bool, process: str, level: int | None = None) -> None:
    """Route every logger (uvicorn's included) to stderr in the chosen format; `process`
    names this process in each line (`launcher`, `shard-0`, `router`). The level: `level`,
    else `LOG_LEVEL`'s, else INFO."""
    if level is None:
        level = level_from_env()
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(process=process)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
