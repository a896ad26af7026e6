from __future__ import annotations

import pytest

from textgate.client import errors
from textgate.client.errors import parse_error


@pytest.mark.parametrize(
    ("status", "error_type", "expected"),
    [
        (422, "validation", errors.ValidationError),
        (424, "generation", errors.GenerationError),
        (429, "overloaded", errors.OverloadedError),
        (500, "incomplete_generation", errors.IncompleteGenerationError),
        (503, "unhealthy", errors.ShardNotReadyError),
        (401, "unauthorized", errors.UnauthorizedError),
        (404, "model_not_found", errors.NotFoundError),
        (413, "payload_too_large", errors.BadRequestError),
        (200, "stream_buffer_overflow", errors.IncompleteGenerationError),
        # A stream's error event arrives with the stream's 200: error_type alone decides.
        (200, "generation", errors.GenerationError),
        (200, "validation", errors.ValidationError),
        # Without a known error_type, the status decides.
        (400, None, errors.BadRequestError),
        (401, None, errors.UnauthorizedError),
        (403, None, errors.UnauthorizedError),
        (404, None, errors.NotFoundError),
        (422, "template_error", errors.ValidationError),
        (424, None, errors.ShardNotReadyError),
        (429, None, errors.RateLimitExceededError),
        (503, None, errors.ShardNotReadyError),
        (504, None, errors.ShardTimeoutError),
        (500, None, errors.UnknownError),
        (200, None, errors.UnknownError),
    ],
)
def test_mapping(status: int, error_type: str | None, expected: type) -> None:
    payload = {"error": "the server's words"}
    if error_type is not None:
        payload["error_type"] = error_type
    err = parse_error(status, payload)
    assert type(err) is expected
    assert str(err) == err.message == "the server's words"
    assert (err.status_code, err.error_type) == (status, error_type)


def test_openai_shaped_error() -> None:
    err = parse_error(400, {"error": {"message": "bad model", "type": "invalid_request_error"}})
    assert isinstance(err, errors.BadRequestError)
    assert (err.message, err.error_type) == ("bad model", "invalid_request_error")


def test_textgates_openai_error_is_typed_by_its_tgi_error_type() -> None:
    body = {
        "error": {"message": "too long", "type": "invalid_request_error", "param": None},
        "error_type": "validation",
    }
    err = parse_error(422, body)
    assert isinstance(err, errors.ValidationError)
    assert (err.message, err.error_type) == ("too long", "validation")


def test_non_tgi_payload_becomes_the_message() -> None:
    err = parse_error(502, "<html>bad gateway</html>")
    assert isinstance(err, errors.UnknownError)
    assert err.message == "<html>bad gateway</html>"


def test_every_error_is_a_textgate_error_and_builtin_kinds_hold() -> None:
    assert issubclass(errors.ClientTimeoutError, TimeoutError)
    assert issubclass(errors.ConnectionFailedError, ConnectionError)
    for name in dir(errors):
        value = getattr(errors, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, errors.TextGateError)
    # Constructed with the message alone, as with the text_generation client.
    assert str(errors.ValidationError("x")) == "x"
