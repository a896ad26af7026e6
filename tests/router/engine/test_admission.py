"""The admitted-requests table: all-or-none admission, failing, and routing a step's answer."""

from __future__ import annotations

import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.admission import Admitted, OverloadedError
from textgate.router.engine.channel import ErrorEvent, StepEvent
from textgate.router.engine.request import SamplingParams, StoppingParams, ValidRequest


def request() -> ValidRequest:
    return ValidRequest(
        inputs="w5",
        input_ids=(5,),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=4),
    )


def token(request_id: int, token_id: int, *, done: bool = False, error: str = "") -> pb.Generation:
    generation = pb.Generation(
        request_id=request_id,
        tokens=pb.Tokens(ids=[token_id], logprobs=[-0.5], texts=["x"], is_special=[False]),
        error=error,
    )
    if done:
        generation.generated_text.CopyFrom(pb.GeneratedText(text="xx", generated_tokens=2))
    return generation


def test_admission_is_all_or_none_and_stops_once_closed() -> None:
    admitted = Admitted(max_active=3)
    first = admitted.admit([request(), request()], on_cancel=lambda: None)
    assert [e.id for e in first] == [0, 1] and len(admitted) == 2
    with pytest.raises(OverloadedError):
        admitted.admit([request(), request()], on_cancel=lambda: None)
    assert len(admitted) == 2
    admitted.closed = True
    with pytest.raises(OverloadedError):
        admitted.admit([request()], on_cancel=lambda: None)


def test_a_cancelled_channel_calls_the_wake_up() -> None:
    woken: list[int] = []
    (entry,) = Admitted(1).admit([request()], on_cancel=lambda: woken.append(1))
    entry.channel.cancel()
    assert woken == [1]


def test_route_delivers_releases_the_finished_and_fails_the_refused_and_the_lost() -> None:
    admitted = Admitted(max_active=8)
    running, done, refused, lost = admitted.admit([request()] * 4, on_cancel=lambda: None)
    generations = [
        token(running.id, 11),
        token(done.id, 12, done=True),
        pb.Generation(request_id=refused.id, error="grammar does not compile"),
        token(99, 13),  # a request the table no longer has: ignored
    ]
    routed = admitted.route(
        generations, expected_ids=[e.id for e in (running, done, refused, lost)]
    )
    assert routed.sampled == {running.id: [11], done.id: [12]}
    assert routed.finished == {done.id}
    assert [e.id for e in routed.failed] == [refused.id, lost.id]
    assert list(admitted) == [running]
    (step,) = done.channel.take()
    assert isinstance(step, StepEvent) and step.finished is not None
    assert refused.channel.take() == [ErrorEvent("grammar does not compile", "validation")]
    assert lost.channel.take() == [ErrorEvent("Incomplete generation", "incomplete_generation")]


def test_route_keeps_what_the_shards_say_they_run() -> None:
    admitted = Admitted(max_active=4)
    quiet, gone = admitted.admit([request(), request()], on_cancel=lambda: None)
    routed = admitted.route([], expected_ids=[quiet.id, gone.id], running={quiet.id})
    assert [e.id for e in routed.failed] == [gone.id]
    assert list(admitted) == [quiet]


def test_fail_ids_fails_only_the_admitted_ones() -> None:
    admitted = Admitted(max_active=4)
    (entry,) = admitted.admit([request()], on_cancel=lambda: None)
    failed = admitted.fail_ids([entry.id, 42], "boom")
    assert failed == [entry] and len(admitted) == 0
    assert entry.channel.take() == [ErrorEvent("boom")]


def test_route_counts_each_requests_verified_and_accepted_drafts() -> None:
    admitted = Admitted(max_active=4)
    speculating, plain = admitted.admit([request(), request()], on_cancel=lambda: None)
    three = pb.Generation(request_id=speculating.id, tokens=pb.Tokens(ids=[1, 2, 3]))
    admitted.route(
        [three, token(plain.id, 9)], [speculating.id, plain.id], num_drafts={speculating.id: 4}
    )
    one = pb.Generation(request_id=speculating.id, tokens=pb.Tokens(ids=[4]))
    admitted.route([one], [speculating.id], num_drafts={speculating.id: 2})
    # 4 drafts, 2 accepted (3 tokens); then 2 drafts, none accepted (1 token).
    assert (speculating.channel.num_draft_tokens, speculating.channel.num_accepted_tokens) == (6, 2)
    assert (plain.channel.num_draft_tokens, plain.channel.num_accepted_tokens) == (0, 0)
