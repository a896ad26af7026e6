"""From channel events to /generate bodies and /generate_stream frames."""

from __future__ import annotations

import json
from typing import Any

import pytest

from textgate.router.engine.channel import Channel, ErrorEvent, Finished, StepEvent, TokenInfo
from textgate.router.generation.result import Generated, GenerationError, best_of, collect
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.tgi.output import generate_response, stream_frames


def tok(i: int, logprob: float = -0.5) -> TokenInfo:
    return TokenInfo(id=i, text=f" t{i}", logprob=logprob)


def done(text: str, n: int, reason: Any = "length", seed: int | None = None) -> Finished:
    return Finished(text=text, generated_tokens=n, finish_reason=reason, seed=seed)


def channel_with(*events: StepEvent | ErrorEvent, input_length: int = 1) -> Channel:
    channel = Channel(input_length)
    for event in events:
        channel.push(event)
    return channel


async def frames_of(channel: Channel, **params: Any) -> list[dict[str, Any]]:
    """The events of every write, in order (a write carries every event that was due)."""
    writes = [w async for w in stream_frames(channel, GenerateParameters(**params), "prompt")]
    assert all(w.startswith(b"data: ") and w.endswith(b"\n\n") for w in writes)
    frames = [f for w in writes for f in w.split(b"\n\n")[:-1]]
    return [json.loads(f[len(b"data: ") :]) for f in frames]


async def test_collect_gathers_tokens_until_the_end() -> None:
    channel = channel_with(
        StepEvent([tok(1)], prefill=[tok(0)]),
        StepEvent([tok(2)], finished=done(" t1 t2", 2)),
    )
    generated = await collect(channel)
    assert [t.id for t in generated.tokens] == [1, 2]
    assert [t.id for t in generated.prefill] == [0]
    assert generated.finished.text == " t1 t2"


async def test_collect_raises_the_error_event() -> None:
    channel = channel_with(StepEvent([tok(1)]), ErrorEvent("boom", "generation"))
    with pytest.raises(GenerationError, match="boom") as caught:
        await collect(channel)
    assert caught.value.error_type == "generation"


def test_best_of_picks_the_highest_logprob_sum() -> None:
    def candidate(*logprobs: float) -> Generated:
        tokens = [tok(i, lp) for i, lp in enumerate(logprobs)]
        return Generated(done("", len(tokens)), 1, 0.0, 0.0, tokens=tokens)

    a, b, c = candidate(-1, -1), candidate(-0.1, -0.2), candidate(-3)
    best, others = best_of([a, b, c])
    assert best is b and others == [a, c]


def test_generate_response_without_details_is_just_the_text() -> None:
    generated = Generated(done(" t1", 1), 1, 0.0, 0.0, tokens=[tok(1)])
    body = generate_response(generated, [], GenerateParameters(), "w0")
    assert body.model_dump(mode="json") == {"generated_text": " t1"}


def test_best_of_sequences_carry_the_prompt_when_full_text_is_asked() -> None:
    best = Generated(done(" a", 1, seed=1), 1, 0.0, 0.0, tokens=[tok(1)])
    other = Generated(done(" b", 1, "eos_token", seed=2), 1, 0.0, 0.0, tokens=[tok(2)])
    params = GenerateParameters(details=True, return_full_text=True)
    body = generate_response(best, [other], params, "p").model_dump(mode="json")
    assert body["generated_text"] == "p a"
    (sequence,) = body["details"]["best_of_sequences"]
    assert sequence == {
        "generated_text": "p b",
        "finish_reason": "eos_token",
        "generated_tokens": 1,
        "seed": 2,
        "prefill": [],
        "tokens": [{"id": 2, "text": " t2", "logprob": -0.5, "special": False}],
    }


async def test_stream_frames_number_every_token_of_multi_token_steps() -> None:
    channel = channel_with(
        StepEvent([tok(1), tok(2)], top_tokens=[[tok(1)], [tok(2), tok(3)]]),
        StepEvent([tok(3), tok(4)], finished=done(" t1 t2 t3 t4", 4, seed=9)),
        input_length=3,
    )
    frames = await frames_of(channel, details=True, return_full_text=True)
    assert [f["index"] for f in frames] == [1, 2, 3, 4]
    assert [len(f.get("top_tokens", [])) for f in frames] == [1, 2, 0, 0]
    assert [f["generated_text"] for f in frames] == [None, None, None, "prompt t1 t2 t3 t4"]
    assert frames[-1]["details"] == {
        "finish_reason": "length",
        "generated_tokens": 4,
        "seed": 9,
        "input_length": 3,
    }


async def test_stream_frames_end_with_the_error() -> None:
    channel = channel_with(StepEvent([tok(1)]), ErrorEvent("boom", "generation"))
    frames = await frames_of(channel)
    assert frames[-1] == {"error": "boom", "error_type": "generation"}
    assert len(frames) == 2


async def test_a_finish_without_tokens_is_an_incomplete_generation() -> None:
    channel = channel_with(StepEvent([], finished=done("", 0)))
    frames = await frames_of(channel)
    assert frames == [{"error": "Incomplete generation", "error_type": "incomplete_generation"}]


async def test_a_closed_stream_cancels_its_request() -> None:
    channel = channel_with(StepEvent([tok(1)]))
    frames = stream_frames(channel, GenerateParameters(), "")
    await anext(frames)
    await frames.aclose()
    assert channel.cancelled


def test_greedy_answers_hide_the_shards_seed() -> None:
    best = Generated(done(" t1", 1, seed=9), input_length=1, queued_at=0, started_at=0)
    params = GenerateParameters(details=True)
    assert generate_response(best, [], params, "", sampled=False).details.seed is None  # type: ignore[union-attr]
    assert generate_response(best, [], params, "", sampled=True).details.seed == 9  # type: ignore[union-attr]


async def test_stream_end_is_reported_before_the_last_frame() -> None:
    ends: list[Any] = []
    finished = done(" t1", 1, seed=9)
    channel = channel_with(StepEvent([tok(1)], finished=finished))
    params = GenerateParameters(details=True)
    frames = [
        f async for f in stream_frames(channel, params, "", sampled=False, on_end=ends.append)
    ]
    assert ends == [finished]
    assert json.loads(frames[-1][len(b"data: ") :])["details"]["seed"] is None
    failing = channel_with(StepEvent([tok(1)]), ErrorEvent("boom", "generation"))
    [f async for f in stream_frames(failing, params, "", on_end=ends.append)]
    assert ends[-1] == ErrorEvent("boom", "generation")
    cut = channel_with(StepEvent([], finished=done("", 0)))
    [f async for f in stream_frames(cut, params, "", on_end=ends.append)]
    assert ends[-1].error_type == "incomplete_generation"


async def test_details_say_what_speculation_did_for_the_request() -> None:
    steps = (StepEvent([tok(1)]), StepEvent([tok(2), tok(3), tok(4)], finished=done("", 4)))
    speculated = channel_with(*steps)
    speculated.verified(num_drafts=4, num_emitted=3)  # two of four drafts accepted
    generated = await collect(speculated)
    body = generate_response(generated, [], GenerateParameters(details=True), "")
    details = body.model_dump(mode="json")["details"]
    assert details["speculation"] == {"draft_tokens": 4, "accepted_tokens": 2}
    streamed = channel_with(*steps)
    streamed.verified(num_drafts=4, num_emitted=3)
    frames = await frames_of(streamed, details=True)
    assert frames[-1]["details"]["speculation"] == {"draft_tokens": 4, "accepted_tokens": 2}
    # Without drafts (no --speculate), TGI's details exactly: no such field.
    plain = await collect(channel_with(*steps))
    plain_body = generate_response(plain, [], GenerateParameters(details=True), "")
    assert "speculation" not in plain_body.model_dump(mode="json")["details"]
    assert "speculation" not in (await frames_of(channel_with(*steps), details=True))[-1]["details"]
