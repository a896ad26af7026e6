"""The pipeline's typed errors, answered by the route in its API's error shape.

Handlers raise them (a bad request, an unknown model, a full server, a tenant over its
quota, a failed generation, a body too large); `answers_typed_errors` answers each with
its status, the body of the API the path belongs to (`errors.error_api`) and, for a
quota, `Retry-After`. The app answers them the same way (`typed_error_response`); the
wrapper keeps a route module's routes whole in any app.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from textgate.router.engine.admission import OverloadedError
from textgate.router.engine.quota import ModelNotAllowedError, QuotaExceededError, TokenBudgetError
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
    ModelNotAllowedError,
    OverloadedError,
    QuotaExceededError,
    TokenBudgetError,
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
            return typed_error_response(exc, request.url.path)

    return answer


def typed_error_response(exc: Exception, path: str) -> Response:
    """The answer to a typed error on `path`: its status and its API's body, and the
    `Retry-After` seconds of a quota."""
    error_type = getattr(exc, "error_type", "generation")
    response = error_response(str(exc), error_type, api=error_api(path))
    if isinstance(exc, QuotaExceededError):
        response.headers["retry-after"] = str(exc.retry_after)
    return response
