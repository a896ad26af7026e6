"""The chat playground: a single page, shipped in the package, that streams from the server.

`GET /chat` (and `GET /` when the client asks for HTML, as a browser does) answers the
page; its script and style are two sibling files under `static/`. Nothing is built and
nothing is fetched from elsewhere, so it works offline. The page talks to
`/v1/chat/completions` over SSE; `POST /` stays TGI's generate route and `GET /` without
`Accept: text/html` stays TGI's health check.

The page and its files carry no secret, so an API key does not guard them (the page sends
the key the user types in). A strict Content-Security-Policy allows only these files, as a
second fence behind the page's rule of never parsing model text as HTML.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

PLAYGROUND_PATH = "/chat"
STATIC_PACKAGE = "textgate.router.http"
# URL path -> (file under static/, media type).
ASSETS = {
    PLAYGROUND_PATH: ("playground.html", "text/html; charset=utf-8"),
    f"{PLAYGROUND_PATH}/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    f"{PLAYGROUND_PATH}/playground.css": ("playground.css", "text/css; charset=utf-8"),
    f"{PLAYGROUND_PATH}/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
PLAYGROUND_PATHS = frozenset(ASSETS)
"""The paths the playground serves (besides `GET /` for browsers); open under --api-key."""
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

Endpoint = Callable[[Request], Awaitable[Response]]


def static_file(name: str) -> bytes:
    """One of the playground's files, read from the installed package."""
    return (resources.files(STATIC_PACKAGE) / "static" / name).read_bytes()


def with_playground(routes: Sequence[BaseRoute]) -> list[BaseRoute]:
    """`routes` with the playground added: `/chat` and its files, and `GET /` answering
    browsers with the page (anything else there still reaches the route it had)."""
    responses = {
        path: _asset_response(name, media_type) for path, (name, media_type) in ASSETS.items()
    }
    page = responses[PLAYGROUND_PATH]
    wrapped: list[BaseRoute] = []
    for route in routes:
        if isinstance(route, Route) and route.path == "/" and "GET" in (route.methods or ()):
            route = Route("/", _page_for_browsers(page, route.endpoint), methods=["GET"])
        wrapped.append(route)
    for path, endpoint in responses.items():
        wrapped.append(Route(path, endpoint, methods=["GET"]))
    return wrapped


def wants_html(request: Request) -> bool:
    """Whether the request's Accept header lists `text/html` (with a non-zero q)."""
    for item in request.headers.get("accept", "").split(","):
        media_type, *params = (part.strip() for part in item.split(";"))
        if media_type.lower() != "text/html":
            continue
        q = next((p[2:] for p in params if p.replace(" ", "").lower().startswith("q=")), "1")
        try:
            return float(q) > 0
        except ValueError:
            return True
    return False


def _asset_response(name: str, media_type: str) -> Endpoint:
    # Read once at startup: a missing file fails the server's start, not a browser's visit.
    body = static_file(name)

    async def serve(request: Request) -> Response:
        """The chat playground (a page for browsers)."""
        return Response(body, media_type=media_type, headers=HEADERS)

    return serve


def _page_for_browsers(page: Endpoint, endpoint: Endpoint) -> Endpoint:
    @functools.wraps(endpoint)
    async def dispatch(request: Request) -> Response:
        if wants_html(request):
            return await page(request)
        return await endpoint(request)

    return dispatch
