"""POST /invocations, SageMaker's one inference route: the body's shape picks the API.

As in TGI, a body with `messages` is a chat completion, one with `prompt` a
completion, anything else TGI's generate body (answered like `POST /`). The request
is handed, body replayed, to the route that serves that API, so every behaviour
(streaming, errors, metrics, cancellation) is that route's own.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Message, Receive

from textgate.router.http.request_io import read_body

GENERATE_PATH = "/"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def sagemaker_route(routes: Sequence[BaseRoute], payload_limit: int) -> Route:
    """POST /invocations over the POST endpoints of `routes` (which must serve `/`)."""
    endpoints = {
        route.path: route.endpoint
        for route in routes
        if isinstance(route, Route)
        and "POST" in (route.methods or ())
        and (inspect.isfunction(route.endpoint) or inspect.ismethod(route.endpoint))
    }

    async def invocations(request: Request) -> Response:
        """Generate (SageMaker): a chat, completion or TGI generate body, told apart by shape."""
        body = await read_body(request, payload_limit)
        endpoint = endpoints.get(api_path(body)) or endpoints[GENERATE_PATH]
        response: Response = await endpoint(Request(request.scope, _replay(body, request.receive)))
        return response

    return Route("/invocations", invocations, methods=["POST"])


def api_path(body: bytes) -> str:
    """The route whose API `body` belongs to (TGI's generate route when unsure)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return GENERATE_PATH
    if isinstance(payload, dict) and "messages" in payload:
        return CHAT_PATH
    if isinstance(payload, dict) and "prompt" in payload:
        return COMPLETIONS_PATH
    return GENERATE_PATH


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
