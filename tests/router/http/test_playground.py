"""The playground's routes over HTTP: who gets the page, its files, and what stays TGI's.

The page itself is driven in a real browser in test_playground_browser.py.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest
import tomllib
from starlette.requests import Request

import textgate
from textgate.router.http.playground import ASSETS, PLAYGROUND_PATHS, static_file, wants_html

StartRouter = Callable[..., Awaitable[str]]
CHROME_ACCEPT = (
    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
)
STATIC = Path(textgate.__file__).parent / "router" / "http" / "static"


def page() -> str:
    return static_file("playground.html").decode()


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (CHROME_ACCEPT, True),
        ("text/html", True),
        ("TEXT/HTML; charset=utf-8", True),
        ("application/json, text/html;q=0.5", True),
        ("text/html;q=0", False),
        ("text/html; q=0.0", False),
        ("*/*", False),
        ("application/json", False),
        ("", False),
        ("text/htmlx", False),
    ],
)
def test_wants_html_reads_the_accept_header(accept: str, expected: bool) -> None:
    scope = {"type": "http", "headers": [(b"accept", accept.encode())] if accept else []}
    assert wants_html(Request(scope)) is expected


async def test_get_root_gives_browsers_the_page_and_everyone_else_the_health_check(
    router: httpx.AsyncClient,
) -> None:
    for accept in (CHROME_ACCEPT, "text/html"):
        response = await router.get("/", headers={"accept": accept})
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert response.text == page()
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp
    for accept in ("*/*", "application/json", "text/html;q=0"):
        response = await router.get("/", headers={"accept": accept})
        assert (response.status_code, response.content) == (200, b""), accept
        assert "content-security-policy" not in response.headers


async def test_post_root_stays_tgis_generate_route(router: httpx.AsyncClient) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 2}, "stream": False}
    response = await router.post("/", json=body, headers={"accept": CHROME_ACCEPT})
    assert response.status_code == 200
    assert response.json() == [{"generated_text": "w5 t6 t7"}]


async def test_chat_serves_the_page_and_every_file_it_links(router: httpx.AsyncClient) -> None:
    response = await router.get("/chat", headers={"accept": "application/json"})
    assert response.status_code == 200
    assert response.text == page()
    linked = re.findall(r'(?:src|href)="([^"]+)"', page())
    assert len(linked) == 3  # icon, style, script
    for base in ("/", "/chat"):
        # Relative links, so the page also works behind a path prefix: the same files
        # from either address.
        assert {urljoin(base, link) for link in linked} == PLAYGROUND_PATHS - {"/chat"}
    for path, (name, media_type) in ASSETS.items():
        response = await router.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"] == media_type
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.content == (STATIC / name).read_bytes()


async def test_the_page_is_open_under_an_api_key_and_its_requests_are_not(
    start_router: StartRouter,
) -> None:
    async with httpx.AsyncClient(base_url=await start_router(api_key="sesame")) as client:
        for path in PLAYGROUND_PATHS:
            assert (await client.get(path)).status_code == 200, path
        assert (await client.get("/", headers={"accept": CHROME_ACCEPT})).text == page()
        body = {"messages": [{"role": "user", "content": "w5"}], "stream": True}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 401
        assert (await client.get("/info")).status_code == 200  # the page reads the model name


def test_the_page_loads_nothing_from_elsewhere_and_never_parses_model_text_as_html() -> None:
    for name, _ in ASSETS.values():
        text = static_file(name).decode()
        assert not re.search(r"\b(?:https?:)?//[\w.-]+\.\w+", text.replace("http://www.w3.org", ""))
    script = static_file("playground.js").decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script


def test_the_wheel_carries_every_static_file() -> None:
    pyproject = tomllib.loads((STATIC.parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["textgate.router.http"]
    files = sorted(p.name for p in STATIC.iterdir())
    assert files == sorted(name for name, _ in ASSETS.values())
    for name in files:
        assert any(fnmatch.fnmatch(f"static/{name}", glob) for glob in globs), name
