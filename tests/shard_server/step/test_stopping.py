from __future__ import annotations

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.stopping import StoppingCriteria


def criteria(**kwargs: object) -> StoppingCriteria:
    base: dict[str, object] = {"eos_token_ids": frozenset({2}), "max_new_tokens": 10}
    base.update(kwargs)
    return StoppingCriteria(**base)  # type: ignore[arg-type]


def test_max_new_tokens() -> None:
    stop = criteria(max_new_tokens=3)
    assert stop(5, "a") is None
    assert stop(5, "b") is None
    assert stop(5, "c") == pb.FINISH_REASON_LENGTH


def test_eos_and_ignore_eos() -> None:
    assert criteria()(2, "") == pb.FINISH_REASON_EOS_TOKEN
    assert criteria(ignore_eos=True)(2, "") is None


def test_stop_sequence_across_token_boundaries() -> None:
    stop = criteria(stop_sequences=("World!",))
    assert stop(7, "Hello Wo") is None
    assert stop(8, "rl") is None
    assert stop(9, "d! and") == pb.FINISH_REASON_STOP_SEQUENCE


def test_min_new_tokens_suppresses_eos_until_reached() -> None:
    stop = criteria(min_new_tokens=2)
    assert stop.suppress_eos
    stop(5, "x")
    assert stop.suppress_eos
    stop(5, "y")
    assert not stop.suppress_eos


def test_stop_token_ids_end_like_eos_even_when_eos_is_ignored() -> None:
    stop = criteria(stop_token_ids=frozenset({7, 8}), ignore_eos=True)
    assert stop(5, "a") is None
    assert stop(2, "") is None  # eos itself is ignored
    assert stop(8, "b") == pb.FINISH_REASON_EOS_TOKEN


def test_stop_token_ids_come_from_the_request() -> None:
    params = pb.StoppingCriteriaParameters(max_new_tokens=4, stop_token_ids=[9, 11])
    assert StoppingCriteria.from_pb(params, frozenset({2})).stop_token_ids == {9, 11}
