"""`AsyncClient`: the asyncio client, a drop-in for `text_generation.AsyncClient` (0.7.0)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import pydantic

from textgate.client.decoding import EventStream, error_from_body, is_success, parse_body
from textgate.client.openai_types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Message,
    Tool,
)
from textgate.client.payloads import (
    chat_payload,
    completion_payload,
    generate_payload,
    method_arguments,
)
from textgate.client.transport import DEFAULT_TIMEOUT_S, HttpSettings, mapped_transport_errors
from textgate.client.types import Grammar, Response, StreamResponse

T = TypeVar("T", bound=pydantic.BaseModel)


class AsyncClient:
    """Talks to a textgate (or TGI) server over HTTP from asyncio code.

    Example:
        >>> from textgate.client import AsyncClient
        >>> client = AsyncClient("http://127.0.0.1:8080")
        >>> (await client.generate("Why is the sky blue?", max_new_tokens=16)).generated_text
        >>> async for r in client.generate_stream("Hi"):
        ...     print(r.token.text, end="")

    Each call opens its own connection, so one client serves any event loop (as the
    `text_generation` client does); inside `async with AsyncClient(...) as client:` calls
    share a connection pool bound to that loop. Generation parameters are documented on `textgate.client.types.Parameters`.
    Errors are the classes of `textgate.client.errors`; invalid parameters raise
    `ValidationError` before anything is sent.
    """

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str] | None = None,
        cookies: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
        *,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """
        Args:
            base_url: server root, e.g. `http://127.0.0.1:8080`.
            headers: extra headers sent with every request.
            cookies: cookies sent with every request.
            timeout: seconds allowed for each of connect, read (between two chunks of an
                answer), write and pool; an `httpx.Timeout` for finer control, None for none.
            api_key: sent as `Authorization: Bearer <api_key>`.
            transport: an httpx transport to use instead of the network (tests, proxies).
        """
        self.base_url = base_url
        self.headers = headers
        self.cookies = cookies
        self.timeout = timeout
        self._settings = HttpSettings.build(base_url, headers, cookies, timeout, api_key)
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> AsyncClient:
        self._http = self._new_http()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the shared connection pool opened by `async with` (a no-op otherwise)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def generate(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int | None = 20,
        best_of: int | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        decoder_input_details: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | None = None,
        *,
        ignore_eos: bool | None = None,
        min_new_tokens: int | None = None,
    ) -> Response:
        """Generate a continuation of `prompt` (`POST /generate`), with its details."""
        payload = generate_payload(prompt, method_arguments(locals(), "prompt"), stream=False)
        return await self._post("/generate", payload, Response)

    def generate_stream(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int | None = 20,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | None = None,
        *,
        ignore_eos: bool | None = None,
        min_new_tokens: int | None = None,
    ) -> AsyncIterator[StreamResponse]:
        """Stream the tokens of a continuation of `prompt` (`POST /generate_stream`).

        The last item has `generated_text` and `details`. An error event raises the mapped
        error; a stream that ends without its last item raises `IncompleteGenerationError`.
        Leaving the loop early cancels the request once the generator is closed: wrap it in
        `contextlib.aclosing` to close it at once.
        """
        payload = generate_payload(prompt, method_arguments(locals(), "prompt"), stream=True)
        return self._stream("/generate_stream", payload, StreamResponse, until_done=False)

    async def chat(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: list[float] | dict[str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        stream: bool = False,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        *,
        model: str = "tgi",
        stop: list[str] | None = None,
    ) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
        """Chat completion (`POST /v1/chat/completions`); with `stream=True`, an async iterator of chunks.

        Prefer `chat_stream` for streaming: its return type is exact.
        """
        payload = chat_payload(
            messages, method_arguments(locals(), "messages", "stream"), stream=stream
        )
        if stream:
            return self._stream(
                "/v1/chat/completions", payload, ChatCompletionChunk, until_done=True
            )
        return await self._post("/v1/chat/completions", payload, ChatCompletion)

    def chat_stream(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: list[float] | dict[str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: Sequence[Tool | Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        *,
        model: str = "tgi",
        stop: list[str] | None = None,
    ) -> AsyncIterator[ChatCompletionChunk]:
        """Streamed chat completion; ends at `data: [DONE]` (missing: `IncompleteGenerationError`)."""
        payload = chat_payload(messages, method_arguments(locals(), "messages"), stream=True)
        return self._stream("/v1/chat/completions", payload, ChatCompletionChunk, until_done=True)

    async def completion(
        self,
        prompt: str | Sequence[str],
        *,
        model: str = "tgi",
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        stream: bool = False,
    ) -> Completion | AsyncIterator[Completion]:
        """Text completion (`POST /v1/completions`); with `stream=True`, an async iterator of chunks."""
        payload = completion_payload(
            prompt, method_arguments(locals(), "prompt", "stream"), stream=stream
        )
        if stream:
            return self._stream("/v1/completions", payload, Completion, until_done=True)
        return await self._post("/v1/completions", payload, Completion)

    def completion_stream(
        self,
        prompt: str | Sequence[str],
        *,
        model: str = "tgi",
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
    ) -> AsyncIterator[Completion]:
        """Streamed text completion; ends at `data: [DONE]`."""
        payload = completion_payload(prompt, method_arguments(locals(), "prompt"), stream=True)
        return self._stream("/v1/completions", payload, Completion, until_done=True)

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self._transport, **self._settings.client_kwargs())

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[httpx.AsyncClient]:
        if self._http is not None:
            yield self._http
            return
        async with self._new_http() as http:
            yield http

    async def _post(self, path: str, payload: dict[str, Any], item_type: type[T]) -> T:
        url = self._settings.url(path)
        async with self._session() as http, mapped_transport_errors(url, self._settings.timeout):
            response = await http.post(url, json=payload)
        return parse_body(response.status_code, response.content, item_type)

    async def _stream(
        self, path: str, payload: dict[str, Any], item_type: type[T], *, until_done: bool
    ) -> AsyncIterator[T]:
        url = self._settings.url(path)
        async with (
            self._session() as http,
            mapped_transport_errors(url, self._settings.timeout),
            http.stream("POST", url, json=payload) as response,
        ):
            if not is_success(response.status_code):
                raise error_from_body(response.status_code, await response.aread())
            events = EventStream(item_type, until_done=until_done, status_code=response.status_code)
            # codegen: two loop names, so that each loop becomes a `yield from` in client.py.
            async for chunk in response.aiter_bytes():
                for item in events.feed(chunk):
                    yield item
            for leftover in events.close():
                yield leftover
