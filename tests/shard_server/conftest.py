"""Request builders shared by the shard tests (as fixtures: test modules cannot import each other)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from textgate.proto import generate_pb2 as pb


def make_request(
    request_id: int,
    input_ids: list[int],
    max_new_tokens: int,
    *,
    ignore_eos: bool = True,
    **sampling: Any,
) -> pb.Request:
    params: dict[str, Any] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "typical_p": 1.0,
        "repetition_penalty": 1.0,
        "seed": request_id,
    }
    params.update(sampling)
    return pb.Request(
        id=request_id,
        input_ids=input_ids,
        parameters=pb.NextTokenChooserParameters(**params),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, ignore_eos_token=ignore_eos
        ),
    )


@pytest.fixture
def request_factory() -> Callable[..., pb.Request]:
    return make_request
