"""Where textgate keeps files it makes itself: converted models, compiled kernels.

A neutral home so that the shard server (model conversion), the kernels (C build) and the
quantization loaders (a converted GGUF's source) can read it without depending on each other.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: `$TEXTGATE_CACHE`, else `~/.cache/textgate` (read on each call)."""
    env = os.environ.get("TEXTGATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "textgate"


CONVERTED_MARKER = ".textgate-converted"
"""The file a converted model folder holds once complete: the path of the file it was
converted from (a GGUF)."""


def converted_from(folder: Path) -> Path | None:
    """The file `folder` was converted from (None: not a converted folder)."""
    marker = folder / CONVERTED_MARKER
    return Path(marker.read_text().strip()) if marker.is_file() else None


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Held while a cache folder is built (`path` is its lock file), so that processes or
    clones building the same folder at once build it once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
