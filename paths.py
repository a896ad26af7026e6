"""Where textgate keeps files it makes itself: converted models, compiled kernels.

A neutral home so that both the shard server (model conversion) and the kernels (C build)
can read it without depending on each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: `$TEXTGATE_CACHE`, else `~/.cache/textgate` (read on each call)."""
    env = os.environ.get("TEXTGATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "textgate"
