from __future__ import annotations

import httpx
import pytest

from textgate.client.errors import (
    ClientTimeoutError,
    ConnectionFailedError,
    IncompleteGenerationError,
)
from textgate.client.transport import HttpSettings, mapped_transport_errors


def test_settings_from_constructor_arguments() -> None:
    settings = HttpSettings.build("http://h:1/", {"X-A": "1"}, {"c": "2"}, 5, "key")
    assert settings.url("/generate") == "http://h:1/generate"
    assert settings.headers == {"X-A": "1", "Authorization": "Bearer key"}
    kwargs = settings.client_kwargs()
    assert kwargs["cookies"] == {"c": "2"}
    assert kwargs["timeout"] == httpx.Timeout(5)


def test_settings_keep_an_httpx_timeout_and_no_key() -> None:
    timeout = httpx.Timeout(5, read=60)
    settings = HttpSettings.build("http://h", None, None, timeout, None)
    assert settings.timeout is timeout
    assert settings.headers == {}


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (httpx.ReadTimeout("slow"), ClientTimeoutError),
        (httpx.ConnectTimeout("slow"), ClientTimeoutError),
        (httpx.ConnectError("refused"), ConnectionFailedError),
        (httpx.RemoteProtocolError("peer closed"), IncompleteGenerationError),
        (httpx.ReadError("reset"), IncompleteGenerationError),
    ],
)
def test_transport_errors_are_mapped(raised: Exception, expected: type) -> None:
    with pytest.raises(expected) as caught, mapped_transport_errors("http://h/x", httpx.Timeout(2)):
        raise raised
    assert "http://h/x" in str(caught.value)
    assert caught.value.__cause__ is raised


def test_timeout_message_tells_what_to_do() -> None:
    expected = r"ReadTimeout .*timeout 2s.*`timeout=`"
    with (
        pytest.raises(ClientTimeoutError, match=expected),
        mapped_transport_errors("http://h/x", httpx.Timeout(2)),
    ):
        raise httpx.ReadTimeout("slow")


def test_other_errors_pass_through() -> None:
    with pytest.raises(KeyError), mapped_transport_errors("http://h/x", httpx.Timeout(2)):
        raise KeyError("mine")


async def test_transport_errors_are_mapped_under_async_with() -> None:
    raised = httpx.ReadError("reset")
    with pytest.raises(IncompleteGenerationError) as caught:
        async with mapped_transport_errors("http://h/x", httpx.Timeout(2)):
            raise raised
    assert caught.value.__cause__ is raised
