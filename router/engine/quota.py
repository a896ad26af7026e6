"""A tenant's limits and what it uses of them; the `Lease` one HTTP request holds.

Requests per minute and requests in flight are checked when the lease opens (before the
body is read); tokens per minute at admission, when the prompt's length is known. Tokens
are reserved as prompt + max_new_tokens of each request admitted (every candidate of
`n` / `best_of` counts its prompt), and settled to prompt + the tokens really generated
when the HTTP request ends: an early stop (eos, a stop sequence, a client that left)
gives the rest back. The lease of the request being served is a context variable, set by
the HTTP layer, read by validation and admission (as the trace is: router/tracing.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

from textgate.router.engine.channel import Channel
from textgate.router.engine.rate_window import Charge, Clock, SlidingWindow
from textgate.router.engine.request import ValidRequest

LimitKind = Literal["requests_per_minute", "tokens_per_minute", "max_concurrent"]
"""Which limit refused a request (the `limit` label of the per-tenant 429 count)."""

WINDOW_S = 60.0
"""The rate limits' window: one minute, sliding."""

CONCURRENCY_RETRY_S = 1
"""Retry-After of a request over max_concurrent: a slot frees when one of the tenant's
requests ends, which no window predicts, so this is a hint, not a promise."""


@dataclass(frozen=True)
class Limits:
    """What one tenant may use; None is no limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt + generated tokens in any minute."""
    max_concurrent: int | None = None
    """HTTP requests in flight (a stream counts until its last byte)."""
    max_new_tokens: int | None = None
    """A request asking for more is refused (422); one asking for none gets at most this."""
    priority: int | None = None
    """The best (lowest) priority its requests may ask for; None: any."""
    timeout_s: float | None = None
    """The deadline of its requests that set none (seconds from their arrival); None: none."""
    weight: float = 1.0
    """Its share under fair scheduling, relative to other tenants' (router/engine/fairness.py)."""
    models: frozenset[str] | None = None
    """Base model and adapter names it may use; None: all."""

    def allows(self, model: str, base_names: Collection[str] = ()) -> bool:
        """Whether it may run `model` (an adapter, or the base when `model` is among
        `base_names`, the names the base model goes by)."""
        if self.models is None:
            return True
        names = base_names if model in base_names else (model,)
        return any(name in self.models for name in names)


def base_model_names(model_id: str) -> tuple[str, str]:
    """The names the base model goes by in `Limits.models`: its id and that id's last part,
    as `/v1/models` clients shorten it."""
    return model_id, model_id.rstrip("/").split("/")[-1]


class QuotaExceededError(Exception):
    """A tenant is over one of its limits: 429 with Retry-After."""

    error_type = "rate_limited"

    def __init__(self, message: str, limit: LimitKind, retry_after: int) -> None:
        super().__init__(message)
        self.limit: LimitKind = limit
        self.retry_after = retry_after
        """Whole seconds after which the same request fits (as the window stands now)."""


class TokenBudgetError(Exception):
    """A request that needs more tokens than its tenant's whole minute: never fits (422)."""

    error_type = "validation"


class ModelNotAllowedError(Exception):
    """The key may not use the model a request names: 404, as for a model that is not
    served (the answer does not say which one it is)."""

    error_type = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or this API key may not use it")


class TenantQuota:
    """One tenant's limits and its usage: requests and tokens in the last minute, and
    requests in flight. Kept across reloads of the key file (`update`)."""

    def __init__(self, name: str, limits: Limits, clock: Clock = time.monotonic) -> None:
        self.name = name
        self.limits = limits
        self.num_active = 0
        """HTTP requests holding a lease now."""
        self._requests = SlidingWindow(limits.requests_per_minute, WINDOW_S, clock)
        self._tokens = SlidingWindow(limits.tokens_per_minute, WINDOW_S, clock)

    def update(self, limits: Limits) -> None:
        """New limits (a reloaded key file); what was used in the window still counts."""
        self.limits = limits
        self._requests.limit = limits.requests_per_minute
        self._tokens.limit = limits.tokens_per_minute

    def open_lease(self) -> Lease:
        """A lease for one more HTTP request, or QuotaExceededError (max_concurrent,
        requests_per_minute)."""
        limit = self.limits.max_concurrent
        if limit is not None and self.num_active >= limit:
            raise QuotaExceededError(
                f"Too many concurrent requests for tenant `{self.name}`: its limit is {limit} "
                "in flight (max_concurrent). Please try again when one of them ends.",
                "max_concurrent",
                CONCURRENCY_RETRY_S,
            )
        self._check(self._requests, 1, "requests_per_minute", "requests per minute")
        self._requests.charge(1)
        self.num_active += 1
        return Lease(self)

    def reserve_tokens(self, amount: int) -> Charge:
        """Charge `amount` tokens now, or QuotaExceededError / TokenBudgetError."""
        if self._tokens.wait_s(amount) is None:
            raise TokenBudgetError(
                f"This request needs {amount} tokens (prompt + max_new_tokens), more than "
                f"tenant `{self.name}` may use in a minute ({self._tokens.limit}, "
                "tokens_per_minute): lower max_new_tokens or shorten the prompt."
            )
        self._check(self._tokens, amount, "tokens_per_minute", "tokens per minute")
        return self._tokens.charge(amount)

    def tokens_used(self) -> int:
        """Tokens charged in the last minute (reservations as they stand)."""
        return self._tokens.used()

    def _check(self, window: SlidingWindow, amount: int, kind: LimitKind, words: str) -> None:
        wait = window.wait_s(amount)
        if wait is None:
            wait = window.window_s
        if wait > 0:
            retry_after = max(1, math.ceil(wait))
            raise QuotaExceededError(
                f"Rate limit reached for tenant `{self.name}` on {words}: limit "
                f"{window.limit}, used {window.used()}, requested {amount}. Please try "
                f"again in {retry_after}s.",
                kind,
                retry_after,
            )


@dataclass
class _Reservation:
    charge: Charge
    prompt_tokens: int
    channels: list[Channel] = field(default_factory=list)


class Lease:
    """What one HTTP request holds of its tenant's quota: a slot among its requests in
    flight, and the tokens reserved for what it generates."""

    def __init__(self, quota: TenantQuota) -> None:
        self.quota = quota
        self.refused: LimitKind | None = None
        """The limit that refused one of its generations (tokens_per_minute), if one did."""
        self._reservations: list[_Reservation] = []
        self._closed = False

    def reserve(self, requests: Sequence[ValidRequest]) -> None:
        """Reserve prompt + max_new_tokens of each of `requests` (admitted together), or
        QuotaExceededError / TokenBudgetError; `watch` then names their channels."""
        amount = sum(r.input_length + r.max_new_tokens for r in requests)
        try:
            charge = self.quota.reserve_tokens(amount)
        except QuotaExceededError as exc:
            self.refused = exc.limit
            raise
        prompt_tokens = sum(r.input_length for r in requests)
        self._reservations.append(_Reservation(charge, prompt_tokens))

    def watch(self, channels: Sequence[Channel]) -> None:
        """The channels of the requests the last `reserve` was for."""
        self._reservations[-1].channels.extend(channels)

    def close(self) -> int:
        """Settle every reservation to prompt + generated and free the slot; gives the
        tokens generated. Only the first call does anything."""
        if self._closed:
            return 0
        self._closed = True
        self.quota.num_active -= 1
        generated = 0
        for reservation in self._reservations:
            tokens = sum(c.num_generated for c in reservation.channels)
            generated += tokens
            used = reservation.prompt_tokens + tokens
            reservation.charge.amount = min(reservation.charge.amount, used)
        return generated


_current: ContextVar[Lease | None] = ContextVar("textgate_lease", default=None)


def current_lease() -> Lease | None:
    """The lease of the HTTP request this task serves; None where keys are not required."""
    return _current.get()


@contextmanager
def leased(lease: Lease) -> Iterator[Lease]:
    """`lease` is the current one inside the block (the HTTP request it is for)."""
    token = _current.set(lease)
    try:
        yield lease
    finally:
        _current.reset(token)
