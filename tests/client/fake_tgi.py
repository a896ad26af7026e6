"""A fake TGI server for the client tests: TGI's routes, JSON shapes, errors and SSE framing.

It "generates" a canned sentence token by token. The prompt (or the last chat message)
steers it:

    error <status> <error_type>   answer `status` with {"error", "error_type"} (`-`: no error_type)
    openai-error <status> <type>  answer `status` with OpenAI's {"error": {"message", "type"}}
    text <status>                 answer `status` with a plain-text body
    sleep <seconds>               wait, then answer normally
    fail mid-stream               stream two tokens, then a `generation` error event
    cut stream                    stream two tokens, then end without the final event

Run it by hand: `python tests/client/fake_tgi.py 8099`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = [" The", " sky", " is", " blue", "."]
EOS = {"id": 2, "text": "</s>", "logprob": -0.01, "special": True}
MODEL_ID = "fake/tiny-model"
MAX_NEW_TOKENS = 500
MAX_TOP_N_TOKENS = 5
MAX_STOP_SEQUENCES = 4
MAX_BEST_OF = 2


@dataclass
class Generation:
    """The canned continuation, cut by max_new_tokens, stop sequences or eos."""

    tokens: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"


class FakeError(Exception):
    """An error answer the fake server sends."""

    def __init__(self, status: int, message: str, error_type: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.message}
        if self.error_type is not None:
            body["error_type"] = self.error_type
        return body


def canned_generation(max_new_tokens: int, stop: list[str]) -> Generation:
    """Up to `max_new_tokens` tokens of WORDS followed by eos."""
    generation = Generation()
    for step in range(max_new_tokens):
        if step >= len(WORDS):
            generation.tokens.append(dict(EOS))
            generation.finish_reason = "eos_token"
            return generation
        token = {
            "id": 100 + step,
            "text": WORDS[step],
            "logprob": -0.5 - step / 10,
            "special": False,
        }
        generation.tokens.append(token)
        generation.text += token["text"]
        if any(generation.text.endswith(s) for s in stop):
            generation.finish_reason = "stop_sequence"
            return generation
    return generation


def top_tokens(token: dict[str, Any], n: int) -> list[dict[str, Any]]:
    alternatives = [
        {"id": 900 + j, "text": f" alt{j}", "logprob": -5.0 - j, "special": False}
        for j in range(n - 1)
    ]
    return [token, *alternatives][:n]


def validate(inputs: str, params: dict[str, Any]) -> None:
    """TGI-like limits; raises a 422 `validation` FakeError."""
    problems = [
        (not inputs, "`inputs` cannot be empty"),
        ((params.get("max_new_tokens") or 0) > MAX_NEW_TOKENS, "`max_new_tokens` must be <= 500"),
        ((params.get("top_n_tokens") or 0) > MAX_TOP_N_TOKENS, "`top_n_tokens` must be <= 5"),
        (
            len(params.get("stop") or []) > MAX_STOP_SEQUENCES,
            "`stop` supports up to 4 stop sequences",
        ),
        ((params.get("best_of") or 1) > MAX_BEST_OF, "`best_of` must be <= 2"),
    ]
    for failed, message in problems:
        if failed:
            raise FakeError(422, f"Input validation error: {message}", "validation")


async def obey_command(prompt: str) -> None:
    """Raise the error a steering prompt asks for, or sleep."""
    words = prompt.split()
    if len(words) == 3 and words[0] == "error":
        error_type = None if words[2] == "-" else words[2]
        raise FakeError(int(words[1]), f"fake {words[2]} error", error_type)
    if len(words) == 2 and words[0] == "sleep":
        await asyncio.sleep(float(words[1]))


def generate_answer(inputs: str, params: dict[str, Any]) -> dict[str, Any]:
    generation = canned_generation(params.get("max_new_tokens") or 20, params.get("stop") or [])
    text = inputs + generation.text if params.get("return_full_text") else generation.text
    if not params.get("details"):
        return {"generated_text": text}
    return {"generated_text": text, "details": details(inputs, params, generation)}


def details(inputs: str, params: dict[str, Any], generation: Generation) -> dict[str, Any]:
    body = {
        "finish_reason": generation.finish_reason,
        "generated_tokens": len(generation.tokens),
        "seed": seed(params),
        "prefill": prefill(inputs) if params.get("decoder_input_details") else [],
        "tokens": generation.tokens,
    }
    n = params.get("top_n_tokens")
    if n:
        body["top_tokens"] = [top_tokens(token, n) for token in generation.tokens]
    best_of = params.get("best_of") or 1
    if best_of > 1:
        extra = {
            k: body[k] for k in ("finish_reason", "generated_tokens", "seed", "prefill", "tokens")
        }
        body["best_of_sequences"] = [{"generated_text": generation.text, **extra}] * (best_of - 1)
    return body


def seed(params: dict[str, Any]) -> int | None:
    return (params.get("seed") or 1234) if params.get("do_sample") else None


def prefill(inputs: str) -> list[dict[str, Any]]:
    return [
        {"id": 10 + i, "text": word, "logprob": None if i == 0 else -1.0}
        for i, word in enumerate(inputs.split())
    ]


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def split_in_two(text: str) -> list[str]:
    # Cut each event mid-JSON so readers meet events that span several network chunks.
    middle = len(text) // 2
    return [text[:middle], text[middle:]]


async def generate_events(inputs: str, params: dict[str, Any]) -> AsyncIterator[str]:
    """TGI's `/generate_stream` events; validation errors arrive as an event, as in TGI."""
    try:
        validate(inputs, params)
    except FakeError as err:
        yield sse(err.payload())
        return
    yield ": keep-alive\n\n"
    generation = canned_generation(params.get("max_new_tokens") or 20, params.get("stop") or [])
    n = params.get("top_n_tokens") or 0
    last = len(generation.tokens) - 1
    for index, token in enumerate(generation.tokens):
        if index == 2 and inputs in ("fail mid-stream", "cut stream"):
            if inputs == "fail mid-stream":
                yield sse({"error": "fake failure mid-stream", "error_type": "generation"})
            return
        event: dict[str, Any] = {
            "index": index + 1,
            "token": token,
            "top_tokens": top_tokens(token, n) if n else [],
            "generated_text": None,
            "details": None,
        }
        if index == last:
            text = inputs + generation.text if params.get("return_full_text") else generation.text
            event["generated_text"] = text
            event["details"] = {
                "finish_reason": generation.finish_reason,
                "generated_tokens": len(generation.tokens),
                "seed": seed(params),
                "input_length": len(inputs.split()),
            }
        for piece in split_in_two(sse(event)):
            yield piece


def record(request: Request, body: Any) -> None:
    request.app.state.requests.append(
        {
            "path": request.url.path,
            "headers": dict(request.headers),
            "cookies": dict(request.cookies),
            "json": body,
        }
    )


def check_auth(request: Request) -> None:
    api_key = request.app.state.api_key
    if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
        raise FakeError(401, "Unauthorized", "unauthorized")


async def answer_prelude(request: Request, prompt: str) -> Response | None:
    """Auth, plain-text and OpenAI-style errors, then the steering commands."""
    check_auth(request)
    words = prompt.split()
    if len(words) == 2 and words[0] == "text":
        return PlainTextResponse("<html>bad gateway</html>", status_code=int(words[1]))
    if len(words) == 3 and words[0] == "openai-error":
        body = {"error": {"message": f"fake {words[2]}", "type": words[2], "code": None}}
        return JSONResponse(body, status_code=int(words[1]))
    await obey_command(prompt)
    return None


def error_response(err: FakeError) -> JSONResponse:
    return JSONResponse(err.payload(), status_code=err.status)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def generate(request: Request) -> Response:
    body = await request.json()
    record(request, body)
    inputs, params = body.get("inputs", ""), body.get("parameters") or {}
    try:
        early = await answer_prelude(request, inputs)
        if early is not None:
            return early
        validate(inputs, params)
    except FakeError as err:
        return error_response(err)
    return JSONResponse(generate_answer(inputs, params))


async def generate_stream(request: Request) -> Response:
    body = await request.json()
    record(request, body)
    inputs, params = body.get("inputs", ""), body.get("parameters") or {}
    try:
        early = await answer_prelude(request, inputs)
    except FakeError as err:
        return error_response(err)
    return early or event_stream(generate_events(inputs, params))


async def compat_generate(request: Request) -> Response:
    """TGI's `/`: a stream when `stream` is true, else a one-element list."""
    body = await request.json()
    if body.get("stream"):
        return await generate_stream(request)
    answer = await generate(request)
    if answer.status_code != 200 or not isinstance(answer, JSONResponse):
        return answer
    return JSONResponse([json.loads(answer.body)])


def finish_reason_openai(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def openai_envelope(object_name: str) -> dict[str, Any]:
    return {
        "id": "",
        "object": object_name,
        "created": int(time.time()),
        "model": MODEL_ID,
        "system_fingerprint": "fake-0.1",
    }


def usage(prompt: str, generation: Generation) -> dict[str, int]:
    prompt_tokens, completion_tokens = len(prompt.split()), len(generation.tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def chat_completions(request: Request) -> Response:
    body = await request.json()
    record(request, body)
    messages = body.get("messages") or [{}]
    prompt = messages[-1].get("content") or ""
    try:
        early = await answer_prelude(request, prompt)
        if early is not None:
            return early
    except FakeError as err:
        return error_response(err)
    generation = canned_generation(body.get("max_tokens") or 20, body.get("stop") or [])
    if body.get("stream"):
        return event_stream(chat_events(prompt, generation))
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": generation.text},
        "logprobs": None,
        "finish_reason": finish_reason_openai(generation.finish_reason),
    }
    answer = {**openai_envelope("chat.completion"), "choices": [choice]}
    return JSONResponse({**answer, "usage": usage(prompt, generation)})


async def chat_events(prompt: str, generation: Generation) -> AsyncIterator[str]:
    last = len(generation.tokens) - 1
    for index, token in enumerate(generation.tokens):
        if index == 2 and prompt == "fail mid-stream":
            yield sse({"error": "fake failure mid-stream", "error_type": "generation"})
            return
        if index == 2 and prompt == "cut stream":
            return
        content = "" if token["special"] else token["text"]
        reason = finish_reason_openai(generation.finish_reason) if index == last else None
        delta = {"role": "assistant", "content": content}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        yield sse({**openai_envelope("chat.completion.chunk"), "choices": [choice], "usage": None})
    yield ": done soon\n\n"
    yield "data: [DONE]\n\n"


async def completions(request: Request) -> Response:
    body = await request.json()
    record(request, body)
    prompt = body.get("prompt") or ""
    prompt = prompt if isinstance(prompt, str) else prompt[0]
    try:
        early = await answer_prelude(request, prompt)
        if early is not None:
            return early
    except FakeError as err:
        return error_response(err)
    generation = canned_generation(body.get("max_tokens") or 20, body.get("stop") or [])
    if body.get("stream"):
        return event_stream(completion_events(generation))
    reason = finish_reason_openai(generation.finish_reason)
    choice = {"index": 0, "text": generation.text, "logprobs": None, "finish_reason": reason}
    answer = {**openai_envelope("text_completion"), "choices": [choice]}
    return JSONResponse({**answer, "usage": usage(prompt, generation)})


async def completion_events(generation: Generation) -> AsyncIterator[str]:
    """Completion chunks, framed with CRLF line ends (allowed by the SSE spec)."""
    last = len(generation.tokens) - 1
    for index, token in enumerate(generation.tokens):
        reason = finish_reason_openai(generation.finish_reason) if index == last else None
        text = "" if token["special"] else token["text"]
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        payload = {**openai_envelope("text_completion"), "choices": [choice]}
        yield f"data: {json.dumps(payload)}\r\n\r\n"
    yield "data: [DONE]\r\n\r\n"


def create_app(api_key: str | None = None) -> Starlette:
    """The fake server; with `api_key`, every route wants `Authorization: Bearer <api_key>`."""
    app = Starlette(
        routes=[
            Route("/", compat_generate, methods=["POST"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/generate_stream", generate_stream, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    app.state.api_key = api_key
    app.state.requests = []
    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
