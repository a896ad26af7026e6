"""`python -m textgate.router --config-json '<json>'`: the router process the launcher starts.

The JSON object's keys are the fields of `RouterConfig`. Exit codes: 0 after a
SIGTERM/SIGINT shutdown, 2 for a bad config, 1 when the shards fail at startup.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from textgate.logs import setup_logging
from textgate.router.config import RouterConfig

log = logging.getLogger("textgate.router")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m textgate.router")
    parser.add_argument("--config-json", required=True, help="RouterConfig fields as JSON")
    args = parser.parse_args(argv)
    try:
        config = RouterConfig.from_json(args.config_json)
    except ValueError as exc:
        print(f"textgate.router: invalid config: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.json_output, "router")
    # A signal during startup (connecting, warming up) ends the process cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    from textgate.router.server import serve
    from textgate.router.shard_client import ShardError

    try:
        asyncio.run(serve(config))
    except Exception as exc:
        expected = isinstance(exc, (RuntimeError, ShardError))
        log.error("Router failed: %s", exc, exc_info=not expected)
        return 1
    log.info("Router stopped")
    return 0


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
