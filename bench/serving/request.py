"""Send one streaming request and time every token the way `vllm bench serve` does.

TTFT is the time from sending the request to the first token-bearing event; every later
token-bearing event adds one inter-token gap (ITL); E2E latency ends at the last
token-bearing event (a trailing usage chunk or `[DONE]` does not extend it). A request
succeeds only when it got at least one token and the server's final event (TGI's
`generated_text`, an OpenAI `finish_reason` or `[DONE]`), with no error event: a stream
cut short is a failed request, not a short one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from textgate.bench.serving.backends import GenerationSettings, StreamBackend, StreamChunk
from textgate.bench.serving.metrics import RequestOutcome
from textgate.bench.serving.sse import SseParser
from textgate.bench.serving.workload import BenchRequest

TokenCounter = Callable[[str], int]
_MAX_ERROR_CHARS = 500


class StreamRecorder:
    """Accumulates one request's stream events (with their arrival times) into an outcome."""

    def __init__(
        self,
        start_time: float,
        prompt_len: int,
        one_token_per_event: bool,
        first_token: asyncio.Event | None = None,
    ) -> None:
        self.start_time = start_time
        self.first_token = first_token  # set when the first token arrives
        self.prompt_len = prompt_len
        self.one_token_per_event = one_token_per_event
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.last_token_time = start_time
        self.num_token_events = 0
        self.text: list[str] = []
        self.reported_output_tokens: int | None = None
        self.saw_final = False
        self.error = ""

    def on_chunk(self, chunk: StreamChunk, now: float) -> None:
        """Record one parsed event that arrived at `now` (perf_counter seconds)."""
        if chunk.error is not None and not self.error:
            self.error = chunk.error
        if chunk.is_token:
            if self.ttft is None:
                self.ttft = now - self.start_time
                if self.first_token is not None:
                    self.first_token.set()
            else:
                self.itl.append(now - self.last_token_time)
            self.last_token_time = now
            self.num_token_events += 1
            self.text.append(chunk.text)
        if chunk.output_tokens is not None:
            self.reported_output_tokens = chunk.output_tokens
        if chunk.prompt_tokens is not None:
            self.prompt_len = chunk.prompt_tokens
        self.saw_final = self.saw_final or chunk.final

    def outcome(self, count_tokens: TokenCounter | None = None) -> RequestOutcome:
        """The outcome once the stream has ended."""
        result = RequestOutcome(
            success=False, prompt_len=self.prompt_len, start_time=self.start_time
        )
        if self.error:
            result.error = self.error
        elif self.ttft is None:
            result.error = "stream ended before the first token"
        elif not self.saw_final:
            result.error = "stream ended without the server's final event"
        if result.error:
            return result
        result.success = True
        result.ttft = self.ttft or 0.0
        result.itl = self.itl
        result.latency = self.last_token_time - self.start_time
        result.output_tokens = self._output_tokens(count_tokens)
        return result

    def _output_tokens(self, count_tokens: TokenCounter | None) -> int:
        # Prefer the server's own count; otherwise events are tokens only for TGI streams,
        # and OpenAI chunks may bundle several tokens, so their text is tokenized instead.
        if self.reported_output_tokens is not None:
            return self.reported_output_tokens
        if self.one_token_per_event or count_tokens is None:
            return self.num_token_events
        return count_tokens("".join(self.text))


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    backend: StreamBackend,
    request: BenchRequest,
    settings: GenerationSettings,
    count_tokens: TokenCounter | None = None,
    first_token: asyncio.Event | None = None,
) -> RequestOutcome:
    """Stream one generation from `base_url` and return what was observed; never raises
    for server or network errors (they become a failed outcome with their message).
    `first_token` is set as soon as the first token arrives, for callers that act on it."""
    start = time.perf_counter()
    recorder = StreamRecorder(start, request.prompt_len, backend.one_token_per_event, first_token)
    try:
        url = base_url.rstrip("/") + backend.path
        async with client.stream("POST", url, json=backend.payload(request, settings)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                recorder.error = f"HTTP {resp.status_code}: {body[:_MAX_ERROR_CHARS]}"
                return recorder.outcome()
            parser = SseParser()
            async for line in resp.aiter_lines():
                data = parser.feed(line)
                if data is not None:
                    recorder.on_chunk(backend.parse(data), time.perf_counter())
            data = parser.flush()
            if data is not None:
                recorder.on_chunk(backend.parse(data), time.perf_counter())
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        # Transport failures and malformed events alike: report, keep the run going.
        recorder.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    return recorder.outcome(count_tokens)
