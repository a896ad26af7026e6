"""A headless Chromium driven over the DevTools protocol, for the playground's browser tests.

No driver binary and no browser download: the system's `chromium` (Debian's package)
runs with `--remote-debugging-pipe`, which speaks CDP as NUL-terminated JSON messages
on file descriptors 3 (commands in) and 4 (answers and events out). Everything is
asyncio, so a test can drive the page while the router it talks to runs in the same
event loop.

    async with Chromium.launch(tmp_path) as browser:
        page = await browser.new_page(width=1280, height=800)
        await page.goto(url)
        assert await page.evaluate("document.title") == "textgate"
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

NOT_INSTALLED = (
    "Chromium is not installed: `make test` (its `browser` step) installs Debian's `chromium` "
    "package with apt-get, as root or with sudo. TEXTGATE_SKIP_BROWSER_TESTS=1 skips these tests."
)
# Headless in a container: no sandbox for root, no GPU, /dev/shm may be tiny, and nothing
# that reaches the network on its own (the tests run offline).
FLAGS = (
    "--headless",
    "--remote-debugging-pipe",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
    "--hide-scrollbars",
)
# argv: the fd Chromium reads commands from, the fd it writes answers to, then its command.
TRAMPOLINE = """
import fcntl, os, sys
commands, answers = (fcntl.fcntl(int(fd), fcntl.F_DUPFD, 5) for fd in sys.argv[1:3])
os.dup2(commands, 3)
os.dup2(answers, 4)
os.closerange(5, 1024)
os.execv(sys.argv[3], sys.argv[3:])
"""


def chromium_executable() -> str | None:
    """The system Chromium's path ($CHROMIUM overrides), or None when there is none."""
    override = os.environ.get("CHROMIUM")
    if override:
        return shutil.which(override)
    return shutil.which("chromium") or shutil.which("chromium-browser")


class CdpError(RuntimeError):
    """A CDP command failed, or the page threw."""


class Chromium:
    """One headless browser process and its CDP pipe."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        to_browser: int,
        from_browser: asyncio.StreamReader,
    ) -> None:
        self._process = process
        self._to_browser = to_browser
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        """Every event received, in order (`method`, `params`, `sessionId`)."""
        self._reader = asyncio.get_running_loop().create_task(self._read(from_browser))

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(cls, profile_dir: Path) -> AsyncIterator[Chromium]:
        """Start Chromium with a fresh profile in `profile_dir`; close it on exit."""
        executable = chromium_executable()
        if executable is None:
            raise RuntimeError(NOT_INSTALLED)
        # Chromium reads commands from fd 3 and writes to fd 4: a Python trampoline moves our
        # pipe ends there (subprocess keeps passed fds at their own numbers).
        commands_r, commands_w = os.pipe()
        answers_r, answers_w = os.pipe()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            TRAMPOLINE,
            str(commands_r),
            str(answers_w),
            executable,
            *FLAGS,
            f"--user-data-dir={profile_dir}",
            "about:blank",
            pass_fds=(commands_r, answers_w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        os.close(commands_r)
        os.close(answers_w)
        # Screenshots arrive as one base64 message of a few MB.
        answers = asyncio.StreamReader(limit=1 << 28)
        pipe = open(answers_r, "rb", buffering=0)  # noqa: SIM115 - the transport closes it at EOF
        await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(answers), pipe
        )
        browser = cls(process, commands_w, answers)
        try:
            await browser.send("Target.getTargets")
            yield browser
        finally:
            await browser._close()

    async def send(
        self, method: str, params: dict[str, Any] | None = None, session_id: str | None = None
    ) -> dict[str, Any]:
        """Run one CDP command; its result, or CdpError."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        answer = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = answer
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        reply = await asyncio.wait_for(answer, timeout=30)
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def new_page(self, width: int, height: int) -> Page:
        """A new tab of `width` x `height` CSS pixels, with its Page, Runtime and Log events on."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        await page.resize(width, height)
        return page

    async def _read(self, answers: asyncio.StreamReader) -> None:
        while True:
            try:
                raw = await answers.readuntil(b"\0")
            except asyncio.IncompleteReadError:
                break
            message = json.loads(raw[:-1])
            answer = self._pending.pop(message.get("id", -1), None)
            if answer is None:
                self.events.append(message)
            elif not answer.done():
                answer.set_result(message)
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(CdpError("Chromium closed its DevTools pipe"))

    async def _close(self) -> None:
        with contextlib.suppress(CdpError, asyncio.TimeoutError, OSError):
            await asyncio.wait_for(self.send("Browser.close"), timeout=5)
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()
        await self._process.wait()
        os.close(self._to_browser)
        # The reader sees end-of-file once the browser is gone (and closes its pipe end).
        await self._reader


class Page:
    """One tab, reached through its flat CDP session."""

    def __init__(self, browser: Chromium, session_id: str) -> None:
        self._browser = browser
        self._session = session_id

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._browser.send(method, params, self._session)

    def events(self, method: str) -> list[dict[str, Any]]:
        """The params of this page's `method` events so far."""
        return [
            e["params"]
            for e in self._browser.events
            if e.get("method") == method and e.get("sessionId") == self._session
        ]

    def problems(self) -> list[str]:
        """Uncaught exceptions, console errors and browser-logged errors (CSP, network)."""
        found = [
            e["exceptionDetails"].get("exception", {}).get("description")
            or e["exceptionDetails"].get("text", "")
            for e in self.events("Runtime.exceptionThrown")
        ]
        found += [
            " ".join(str(a.get("value", a.get("description", ""))) for a in e["args"])
            for e in self.events("Runtime.consoleAPICalled")
            if e["type"] == "error"
        ]
        found += [
            f"{e['entry']['text']} ({e['entry'].get('url', '')})"
            for e in self.events("Log.entryAdded")
            if e["entry"]["level"] == "error"
        ]
        return found

    async def resize(self, width: int, height: int) -> None:
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
        )

    async def goto(self, url: str) -> None:
        """Navigate and wait until the page and its scripts have loaded."""
        loads = len(self.events("Page.loadEventFired"))
        await self.send("Page.navigate", {"url": url})
        await self.wait_for(lambda: len(self.events("Page.loadEventFired")) > loads)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of `expression` (promises awaited); CdpError if it throws."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CdpError(f"{expression!r} threw: {text}")
        return result["result"].get("value")

    async def wait_until(self, expression: str, timeout_s: float = 10.0) -> Any:
        """Poll `expression` until it is truthy; its value. TimeoutError names it."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still falsy after {timeout_s} s: {expression}")
            await asyncio.sleep(0.02)

    async def wait_for(self, condition: Any, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("the page did not get there in time")
            await asyncio.sleep(0.02)

    async def type_text(self, text: str) -> None:
        """Type into the focused element (as an input method would)."""
        await self.send("Input.insertText", {"text": text})

    async def press_enter(self, *, shift: bool = False) -> None:
        """A real Enter (or Shift+Enter) key press on the focused element."""
        common = {
            "key": "Enter",
            "code": "Enter",
            "windowsVirtualKeyCode": 13,
            "modifiers": 8 if shift else 0,
        }
        await self.send("Input.dispatchKeyEvent", {"type": "keyDown", "text": "\r", **common})
        await self.send("Input.dispatchKeyEvent", {"type": "keyUp", **common})

    async def screenshot(self, path: Path) -> bytes:
        """A PNG of the viewport, written to `path`."""
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        data = base64.b64decode(shot["data"])
        path.write_bytes(data)
        return data
