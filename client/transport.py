"""Connection settings shared by `Client` and `AsyncClient`, and transport-error mapping."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from textgate.client.errors import (
    ClientTimeoutError,
    ConnectionFailedError,
    IncompleteGenerationError,
)

# Each of connect / read / write / pool gets this many seconds, as `requests` does with
# the `text_generation` client's `timeout`; a stream may run longer as long as tokens flow.
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HttpSettings:
    """Where and how to reach the server; turned into `httpx` client arguments."""

    base_url: str
    headers: Mapping[str, str]
    cookies: Mapping[str, str]
    timeout: httpx.Timeout

    @classmethod
    def build(
        cls,
        base_url: str,
        headers: Mapping[str, str] | None,
        cookies: Mapping[str, str] | None,
        timeout: float | httpx.Timeout | None,
        api_key: str | None,
    ) -> HttpSettings:
        """Settings from the client constructor's arguments; `api_key` becomes a Bearer header."""
        merged = dict(headers or {})
        if api_key is not None:
            merged["Authorization"] = f"Bearer {api_key}"
        if not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(timeout)
        return cls(base_url.rstrip("/"), merged, dict(cookies or {}), timeout)

    def url(self, path: str) -> str:
        """Absolute URL of a route such as `/generate`."""
        return f"{self.base_url}{path}"

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `httpx.Client` / `httpx.AsyncClient`."""
        return {
            "headers": dict(self.headers),
            "cookies": dict(self.cookies),
            "timeout": self.timeout,
            "verify": default_ssl_context(),
        }


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """One SSL context for every httpx client the process opens.

    Building one loads the CA bundle (~50 ms); sharing it brings a fresh httpx client, as
    each call outside `with` opens, down to about 2 ms.
    """
    return httpx.create_ssl_context()


# Named in lower case like `contextlib.suppress`: it reads as a clause of a `with`.
class mapped_transport_errors:
    """Re-raise httpx's transport failures as the client's own errors.

    A context manager for both `with` and `async with`: an `async with` statement cannot
    hold a plain context manager, and the async client (which client.py is generated from)
    lists this one beside its async ones in a single statement.
    """

    def __init__(self, url: str, timeout: httpx.Timeout) -> None:
        self.url = url
        self.timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        mapped = self._map(exc)
        if mapped is not None:
            raise mapped from exc

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, traceback)

    def _map(self, err: BaseException | None) -> Exception | None:
        if isinstance(err, httpx.TimeoutException):
            return ClientTimeoutError(
                f"{type(err).__name__} on {self.url} (timeout {_describe(self.timeout)}); "
                "pass a larger `timeout=` to the client for slow or long generations"
            )
        if isinstance(err, httpx.ConnectError):
            return ConnectionFailedError(f"cannot connect to {self.url}: {err}")
        if isinstance(err, (httpx.ReadError, httpx.RemoteProtocolError)):
            return IncompleteGenerationError(f"connection to {self.url} lost mid-answer: {err}")
        return None


def _describe(timeout: httpx.Timeout) -> str:
    values = {timeout.connect, timeout.read, timeout.write, timeout.pool}
    if len(values) == 1:
        value = values.pop()
        return "none" if value is None else f"{value:g}s"
    return f"connect={timeout.connect}s read={timeout.read}s"
