"""POST /invocations, SageMaker's one inference route: the body's shape picks the API.

As in TGI, a body with `messages` is a chat completion, one with `prompt` a
completion, anything else TGI's generate body (answered like `POST /`). The request
is handed, body replayed, to the route that serves that API (`http.body_dispatch`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from starlette.routing import BaseRoute, Route

from textgate.router.http.body_dispatch import Endpoint, body_dispatch_route, body_keys

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

    def choose(body: bytes) -> Endpoint:
        return endpoints.get(api_path(body)) or endpoints[GENERATE_PATH]

    summary = "Generate (SageMaker): a chat, completion or TGI generate body, told apart by shape."
    return body_dispatch_route("/invocations", choose, payload_limit, summary)


def api_path(body: bytes) -> str:
    """The route whose API `body` belongs to (TGI's generate route when unsure)."""
    keys = body_keys(body)
    if "messages" in keys:
        return CHAT_PATH
    if "prompt" in keys:
        return COMPLETIONS_PATH
    return GENERATE_PATH
