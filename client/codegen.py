"""Generate the sync `Client` (client.py) from the async source (async_client.py).

Run `python -m textgate.client.codegen`; tests/client/test_codegen.py fails when the
committed client.py differs from what this produces. The steps, in order:

1. Comment lines starting `# codegen:` are notes on generation, left out of client.py.
2. `SYNC_PASSAGES`: prose that says something else for sync code (docstring examples,
   how a stream gets cancelled), swapped as whole passages; each must occur exactly once.
3. `SYNC_TOKENS`: async names and keywords become their sync twins (`async def` -> `def`,
   `AsyncClient` -> `Client`, `aclose` -> `close`, ...), matched as whole words.
4. ruff rewrites `for x in y: yield x`, which async generators must write, as the
   `yield from y` of sync code (its rule UP028).
5. ruff formats the result with the project's settings.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLIENT_DIR = Path(__file__).resolve().parent
ASYNC_SOURCE = CLIENT_DIR / "async_client.py"
SYNC_TARGET = CLIENT_DIR / "client.py"

HEADER = (
    "# Generated from client/async_client.py by `python -m textgate.client.codegen`.\n"
    "# Do not edit: change async_client.py (or codegen.py) and rerun the command.\n"
)

SYNC_PASSAGES: dict[str, str] = {
    "the asyncio client": "the synchronous client",
    " over HTTP from asyncio code.": " over HTTP.",
    """\
        >>> (await client.generate("Why is the sky blue?", max_new_tokens=16)).generated_text
        >>> async for r in client.generate_stream("Hi"):
        ...     print(r.token.text, end="")

    Each call opens its own connection, so one client serves any event loop (as the
    `text_generation` client does); inside `async with AsyncClient(...) as client:` calls
    share a connection pool bound to that loop.""": """\
        >>> client.generate("Why is the sky blue?", max_new_tokens=16).generated_text
        >>> text = "".join(r.token.text for r in client.generate_stream("Hi") if not r.token.special)

    Each call opens its own connection, closed when the answer ends, as the `text_generation`
    client does; inside `with Client(...) as client:` calls share one connection pool.""",
    """\
        Leaving the loop early cancels the request once the generator is closed: wrap it in
        `contextlib.aclosing` to close it at once.""": """\
        Leaving the loop early closes the connection, which cancels the request.""",
}

SYNC_TOKENS: dict[str, str] = {
    "async def": "def",
    "async with": "with",
    "async for": "for",
    "await ": "",
    "AsyncIterator": "Iterator",
    "asynccontextmanager": "contextmanager",
    "AsyncClient": "Client",
    "AsyncBaseTransport": "BaseTransport",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "aclose": "close",
    "aread": "read",
    "aiter_bytes": "iter_bytes",
    "an async iterator": "an iterator",
}

_CODEGEN_NOTE = re.compile(r"^[ \t]*# codegen:.*\n", re.MULTILINE)

# Whole words only: `aclose` must not touch `aclosing`, nor `AsyncClient` a longer name.
_TOKEN_PATTERN = re.compile(
    "|".join(
        rf"\b{re.escape(token)}" + (r"\b" if token[-1].isalnum() else "") for token in SYNC_TOKENS
    )
)


def drop_codegen_notes(source: str) -> str:
    """Remove the `# codegen:` comment lines, which explain the async source's choices."""
    return _CODEGEN_NOTE.sub("", source)


def swap_passages(source: str) -> str:
    """Replace each async passage of `SYNC_PASSAGES` by its sync text."""
    for async_text, sync_text in SYNC_PASSAGES.items():
        count = source.count(async_text)
        if count != 1:
            raise ValueError(
                f"codegen passage occurs {count} times in async_client.py (expected once); "
                f"update SYNC_PASSAGES in client/codegen.py: {async_text[:60]!r}"
            )
        source = source.replace(async_text, sync_text)
    return source


def swap_tokens(source: str) -> str:
    """Replace each whole-word token of `SYNC_TOKENS` by its sync twin."""
    return _TOKEN_PATTERN.sub(lambda match: SYNC_TOKENS[match.group(0)], source)


def _ruff(args: list[str], source: str) -> str:
    # The stdin file name makes ruff read the project's settings (line length, target).
    command = [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(SYNC_TARGET), "-"]
    done = subprocess.run(command, input=source, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed on the generated client:\n{done.stderr}")
    return done.stdout


def render(async_source: str) -> str:
    """The text of client.py for the given async_client.py text."""
    source = swap_tokens(swap_passages(drop_codegen_notes(async_source)))
    # UP028's fix is "unsafe" only for generators driven by `send`; the client's are iterated.
    source = _ruff(["check", "--fix", "--unsafe-fixes", "--select", "UP028"], source)
    return _ruff(["format"], HEADER + source)


def generate() -> str:
    """The text client.py should hold, from the committed async_client.py."""
    return render(ASYNC_SOURCE.read_text())


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else SYNC_TARGET
    target.write_text(generate())
