"""Request plumbing every route module shares: bounded JSON bodies, client disconnects."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

import pydantic
import pydantic_core
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from textgate.router.http.errors import PayloadTooLargeError
from textgate.router.http.validation import ValidationError

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a client that left before its answer (never actually received)."""
BODY_READ_TIMEOUT_S = 60.0
"""Seconds a request's whole body may take to arrive (2 MB in 60 s is 33 KB/s)."""
M = TypeVar("M", bound=pydantic.BaseModel)


class ClientDisconnectedError(Exception):
    """The client closed the connection before its answer was ready."""


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """The body parsed as `model`: PayloadTooLargeError over `limit` bytes, else
    ValidationError (422) with TGI's "Failed to deserialize..." message when it does not fit."""
    body = await read_body(request, limit)
    try:
        # Only standard JSON (no NaN/Infinity, no lone surrogates, no overflowing numbers)
        # and no coercion ("5" is not an int, 1 is not a bool): serde's strictness, as TGI.
        _reject_non_finite(pydantic_core.from_json(body, allow_inf_nan=False))
        return model.model_validate_json(body, strict=True)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError too
        raise ValidationError(describe(exc)) from exc


def _reject_non_finite(value: object) -> None:
    """ValueError when a number in the parsed body overflowed to infinity (e.g. 1e999)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"number out of range: {item}")
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; PayloadTooLargeError as soon as it is known to exceed `limit` bytes,
    408 when it has not all arrived within BODY_READ_TIMEOUT_S (a client trickling it)."""
    try:
        return await asyncio.wait_for(_read_body(request, limit), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise HTTPException(408, "Request Timeout") from None
    except ClientDisconnect:
        # Gone before its body was read (uvicorn drops a buffered body once the connection
        # closes): nobody to answer, and no server error to log.
        raise HTTPException(CLIENT_CLOSED_REQUEST, "Client Closed Request") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(limit)
    return bytes(body)


def describe(exc: ValueError) -> str:
    """The first problem of a body that does not deserialize, worded like TGI's."""
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        detail = f"{where}: {first['msg']}" if where else first["msg"]
    else:
        detail = f"Invalid JSON: {exc}"
    return f"Failed to deserialize the JSON body into the target type: {detail}"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first (then ClientDisconnectedError,
    and `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnectedError()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
