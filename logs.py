"""One log format for every textgate process (launcher, shards, router).

Text: `2026-12-01 02:53:18,961 INFO [shard-0] textgate.shard: message`. With
`--json-output`, one JSON object per line: timestamp, level, process, target (the logger),
message, and the access log's `request` fields when a record carries them. The launcher
passes `--json-output` on to the processes it starts, so a log collector reads one shape.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

TEXT_FORMAT = "%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s"


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


def setup_logging(json_output: bool, process: str, level: int = logging.INFO) -> None:
    """Route every logger (uvicorn's included) to stderr in the chosen format; `process`
    names this process in each line (`launcher`, `shard-0`, `router`)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT.format(process=process)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
