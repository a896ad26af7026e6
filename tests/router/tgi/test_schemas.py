"""Request parsing defaults and response JSON: TGI's names, nulls and omitted fields."""

from __future__ import annotations

from textgate.router.generation.schemas import GenerateRequest
from textgate.router.http.errors import ErrorResponse
from textgate.router.tgi.schemas import (
    Details,
    GenerateResponse,
    StreamDetails,
    StreamResponse,
    Token,
)

TOKEN = Token(id=1, text=" a", logprob=-0.1, special=False)


def test_parameters_default_like_tgi() -> None:
    request = GenerateRequest.model_validate({"inputs": "hi"})
    p = request.parameters
    assert (p.details, p.decoder_input_details, p.do_sample, p.watermark) == (
        False,
        False,
        False,
        False,
    )
    assert p.max_new_tokens is None and p.best_of is None and p.stop == []
    assert request.add_special_tokens is True


def test_unknown_fields_are_ignored_like_serde() -> None:
    request = GenerateRequest.model_validate({"inputs": "hi", "parameters": {"new_knob": 1}})
    assert request.inputs == "hi"


def test_null_stop_reads_as_no_stop_sequences() -> None:
    request = GenerateRequest.model_validate({"inputs": "hi", "parameters": {"stop": None}})
    assert request.parameters.stop == []


def test_details_leave_out_empty_optional_fields() -> None:
    details = Details(
        finish_reason="eos_token", generated_tokens=1, seed=None, prefill=[], tokens=[TOKEN]
    )
    assert details.model_dump(mode="json") == {
        "finish_reason": "eos_token",
        "generated_tokens": 1,
        "seed": None,
        "prefill": [],
        "tokens": [{"id": 1, "text": " a", "logprob": -0.1, "special": False}],
    }
    response = GenerateResponse(generated_text="x", details=details).model_dump(mode="json")
    assert set(response) == {"generated_text", "details"}
    assert GenerateResponse(generated_text="x").model_dump(mode="json") == {"generated_text": "x"}


def test_stream_response_keeps_nulls_but_drops_empty_top_tokens() -> None:
    middle = StreamResponse(index=2, token=TOKEN).model_dump(mode="json")
    assert middle == {
        "index": 2,
        "token": {"id": 1, "text": " a", "logprob": -0.1, "special": False},
        "generated_text": None,
        "details": None,
    }
    last = StreamResponse(
        index=3,
        token=TOKEN,
        top_tokens=[TOKEN],
        generated_text="abc",
        details=StreamDetails(
            finish_reason="stop_sequence", generated_tokens=3, seed=4, input_length=2
        ),
    ).model_dump(mode="json")
    assert last["top_tokens"] == [middle["token"]]
    assert last["details"]["finish_reason"] == "stop_sequence"


def test_error_response_shape() -> None:
    body = ErrorResponse(error="Model is overloaded", error_type="overloaded")
    assert body.model_dump(mode="json") == {
        "error": "Model is overloaded",
        "error_type": "overloaded",
    }
