"""The pipeline's typed errors, answered by the route in its API's error shape.

Handlers raise them (a bad request, an unknown model, a full server, a failed
generation, a body too large); `answers_typed_errors` answers each with its status and
the body of the API the path belongs to (`errors.error_api`). The app answers them the
same way; the wrapper keeps a route module's routes whole in any app.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from textgate.router.engine.admission import OverloadedError
from textgate.router.generation.result import GenerationError
from textgate.router.generation.validation import ValidationError
from textgate.router.http.errors import (
    ModelNotFoundError,
    PayloadTooLargeError,
    error_api,
    error_response,
)

Handler = Callable[[Request], Awaitable[Response]]

TYPED_ERRORS: tuple[type[Exception], ...] = (
    ValidationError,
    ModelNotFoundError,
    OverloadedError,
    GenerationError,
    PayloadTooLargeError,
)
"""The errors that carry an `error_type` (TGI's), which picks their status."""


def answers_typed_errors(handler: Handler) -> Handler:
    """`handler`, answering the typed errors in the shape of the request's API."""

    @functools.wraps(handler)
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except TYPED_ERRORS as exc:
            error_type = getattr(exc, "error_type", "generation")
            return error_response(str(exc), error_type, api=error_api(request.url.path))

    return answer
