"""One path, several APIs: a route that hands each request to the endpoint its body's
shape belongs to.

SageMaker's `/invocations` (a chat, completion or TGI body) and `/tokenize` (TGI's
`inputs` or vLLM's `prompt`/`messages`) are such routes. The chosen endpoint gets the
request with its body replayed, so every behaviour (streaming, errors, metrics,
cancellation) is that endpoint's own.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Message, Receive

from textgate.router.http.request_io import read_body

Endpoint = Callable[[Request], Awaitable[Response]]


def body_dispatch_route(
    path: str, choose: Callable[[bytes], Endpoint], payload_limit: int, summary: str
) -> Route:
    """POST `path`, served by `choose(body)`; `summary` is its line in the API docs."""

    async def dispatch(request: Request) -> Response:
        body = await read_body(request, payload_limit)
        endpoint = choose(body)
        return await endpoint(Request(request.scope, _replay(body, request.receive)))

    dispatch.__doc__ = summary
    return Route(path, dispatch, methods=["POST"])


def merge_by_body(
    routes: Sequence[BaseRoute],
    path: str,
    name: str,
    wants: Callable[[bytes], bool],
    payload_limit: int,
) -> list[BaseRoute]:
    """`routes` with their two POST `path` routes made one: a body `wants` accepts goes
    to the one named `name`, any other to the other one (which keeps its place)."""
    posts = [
        r for r in routes if isinstance(r, Route) and r.path == path and "POST" in (r.methods or ())
    ]
    (alternative,) = [r for r in posts if r.name == name]
    (default,) = [r for r in posts if r.name != name]

    def choose(body: bytes) -> Endpoint:
        return alternative.endpoint if wants(body) else default.endpoint

    summary = " / ".join(_summary(r) for r in (default, alternative))
    merged = body_dispatch_route(path, choose, payload_limit, summary)
    return [merged if r is default else r for r in routes if r is not alternative]


def body_keys(body: bytes) -> set[str]:
    """The top-level keys of a JSON object body (none for anything else)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return set()
    return set(payload) if isinstance(payload, dict) else set()


def _summary(route: Route) -> str:
    return (route.endpoint.__doc__ or route.path).strip().splitlines()[0]


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that yields the already-read body first, then the client's own messages
    (so the route still hears a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
