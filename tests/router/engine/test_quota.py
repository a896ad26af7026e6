"""A tenant's quota: requests per minute, requests in flight, tokens reserved at admission
and settled to what was generated, and honest Retry-After."""

from __future__ import annotations

import math

import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.admission import Admitted
from textgate.router.engine.quota import (
    Limits,
    QuotaExceededError,
    TenantQuota,
    TokenBudgetError,
    current_lease,
    leased,
)
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest
from textgate.tests.router.fake_clock import FakeClock


def request(prompt_tokens: int, max_new_tokens: int) -> ValidRequest:
    return ValidRequest(
        inputs="w5",
        input_ids=(5,) * prompt_tokens,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
    )


def generation(request_id: int, *, done: bool = False) -> pb.Generation:
    step = pb.Generation(request_id=request_id, tokens=pb.Tokens(ids=[7], texts=["x"]))
    if done:
        step.generated_text.CopyFrom(pb.GeneratedText(text="x", generated_tokens=1))
    return step


def test_requests_per_minute_and_an_honest_retry_after() -> None:
    clock = FakeClock()
    quota = TenantQuota("team-a", Limits(requests_per_minute=3), clock)
    for _ in range(3):
        quota.open_lease().close()
        clock.now += 1.25
    with pytest.raises(QuotaExceededError) as refused:
        quota.open_lease()
    assert refused.value.limit == "requests_per_minute"
    # The first request leaves at t=0 + 60; it is now t=3.75: whole seconds, rounded up.
    assert refused.value.retry_after == 57
    assert "team-a" in str(refused.value) and "limit 3" in str(refused.value)
    clock.now += refused.value.retry_after - 1
    with pytest.raises(QuotaExceededError):
        quota.open_lease()
    clock.now += 1
    quota.open_lease()


def test_max_concurrent_frees_a_slot_when_a_lease_closes() -> None:
    quota = TenantQuota("t", Limits(max_concurrent=2), FakeClock())
    first, _second = quota.open_lease(), quota.open_lease()
    with pytest.raises(QuotaExceededError) as refused:
        quota.open_lease()
    assert refused.value.limit == "max_concurrent" and refused.value.retry_after >= 1
    first.close()
    first.close()  # a second close frees nothing more
    assert quota.num_active == 1
    quota.open_lease()
    assert quota.num_active == 2


def test_tokens_are_reserved_at_admission_and_settled_to_what_was_generated() -> None:
    clock = FakeClock()
    quota = TenantQuota("t", Limits(tokens_per_minute=100), clock)
    admitted = Admitted(max_active=8)
    lease = quota.open_lease()
    with leased(lease):
        assert current_lease() is lease
        (entry,) = admitted.admit([request(10, 80)], on_cancel=lambda: None)
    assert current_lease() is None
    assert quota.tokens_used() == 90
    other = quota.open_lease()
    with leased(other), pytest.raises(QuotaExceededError) as refused:
        admitted.admit([request(10, 40)], on_cancel=lambda: None)
    assert other.refused == "tokens_per_minute" and len(admitted) == 1
    assert refused.value.retry_after == 60
    # It stops early: 5 tokens of its 80.
    for _ in range(4):
        admitted.route([generation(entry.id)], [entry.id])
    admitted.route([generation(entry.id, done=True)], [entry.id])
    assert lease.close() == 5
    assert quota.tokens_used() == 15
    with leased(other):
        admitted.admit([request(10, 40)], on_cancel=lambda: None)
    assert quota.tokens_used() == 65


def test_every_candidate_counts_and_one_over_the_minute_never_fits() -> None:
    quota = TenantQuota("t", Limits(tokens_per_minute=100), FakeClock())
    admitted = Admitted(max_active=8)
    with leased(quota.open_lease()):
        admitted.admit([request(10, 20)] * 2, on_cancel=lambda: None)
        assert quota.tokens_used() == 60
        with pytest.raises(TokenBudgetError, match="tokens_per_minute"):
            admitted.admit([request(10, 95)], on_cancel=lambda: None)


def test_requests_per_minute_stay_within_5_percent_of_the_limit_under_overload() -> None:
    """A request offered every 50 ms (20x the limit) for 5 minutes: every 60 s span
    accepts 95% to 100% of the limit, and each refusal's Retry-After is when the oldest
    request in the window leaves it."""
    clock = FakeClock()
    limit = 60
    quota = TenantQuota("t", Limits(requests_per_minute=limit), clock)
    accepted: list[float] = []
    start = clock.now
    while clock.now < start + 300:
        try:
            quota.open_lease().close()
            accepted.append(clock.now)
        except QuotaExceededError as refused:
            in_window = [at for at in accepted if at > clock.now - 60]
            assert refused.retry_after == math.ceil(in_window[0] + 60 - clock.now)
        clock.now += 0.05
    for begin in range(60, 241, 5):
        t0 = start + begin
        total = sum(t0 <= at < t0 + 60 for at in accepted)
        assert limit * 0.95 <= total <= limit, (begin, total)


def test_tokens_per_minute_stay_within_5_percent_of_the_limit_under_overload() -> None:
    """Requests offered far above the budget, each stopping early at a varying length:
    what every 60 s span accepts (prompt + generated) is 95% to 100% of the limit."""
    clock = FakeClock()
    limit = 5000
    quota = TenantQuota("t", Limits(tokens_per_minute=limit), clock)
    admitted = Admitted(max_active=1000)
    used: list[tuple[float, int]] = []
    start, n = clock.now, 0
    while clock.now < start + 300:
        lease = quota.open_lease()
        with leased(lease):
            try:
                (entry,) = admitted.admit([request(20, 60)], on_cancel=lambda: None)
            except QuotaExceededError:
                entry = None
        if entry is not None:
            generated = 5 + n % 50
            for i in range(generated):
                admitted.route([generation(entry.id, done=i == generated - 1)], [entry.id])
            used.append((clock.now, 20 + lease.close()))
        else:
            lease.close()
        n += 1
        clock.now += 0.05
    for begin in range(60, 241, 5):
        t0 = start + begin
        total = sum(a for at, a in used if t0 <= at < t0 + 60)
        assert limit * 0.95 <= total <= limit, (begin, total)


def test_new_limits_keep_what_was_used() -> None:
    clock = FakeClock()
    quota = TenantQuota("t", Limits(requests_per_minute=10), clock)
    for _ in range(3):
        quota.open_lease()
    quota.update(Limits(requests_per_minute=3))
    with pytest.raises(QuotaExceededError):
        quota.open_lease()
    quota.update(Limits(requests_per_minute=4))
    quota.open_lease()


def test_models_name_the_base_by_any_of_its_names() -> None:
    base = ("org/base-model", "base-model")
    limits = Limits(models=frozenset({"base-model", "my-adapter"}))
    assert limits.allows("org/base-model", base)
    assert limits.allows("my-adapter", base)
    assert not limits.allows("other-adapter", base)
    assert not Limits(models=frozenset({"my-adapter"})).allows("org/base-model", base)
    assert Limits().allows("anything", base)
