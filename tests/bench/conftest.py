"""Shared fixtures for the benchmark tests: a tiny tokenizer, a tiny model, a fake server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from textgate.bench.serving.workload import load_conversations

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def build_tiny_tokenizer(folder: Path) -> int:
    """Save a word-level tokenizer covering the shipped conversations; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    text = " ".join(m["content"] for chat in load_conversations() for m in chat)
    words = sorted({w for w, _ in pre.pre_tokenize_str(text + " user assistant system :")})
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return len(vocab)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random 2-layer llama with the tiny tokenizer, saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-model")
    vocab_size = build_tiny_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


# ---- a fake TGI + OpenAI streaming server -------------------------------------------------


def _sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class FakeServer:
    """Streams `max_new_tokens` / `max_tokens` tokens with a small delay between them.

    A prompt containing FAIL gets a 422; one containing CUT ends the stream early.
    Every request body is kept in `bodies`. `transformers_serve=True` answers the OpenAI
    routes like `transformers serve`: a 422 for an `ignore_eos` field, and streams that
    close right after the `finish_reason` chunk, with no usage chunk and no `[DONE]`.
    """

    def __init__(self, token_delay_s: float = 0.002) -> None:
        self.token_delay_s = token_delay_s
        self.transformers_serve = False
        self.bodies: list[dict[str, Any]] = []
        self.authorizations: list[str] = []
        """The Authorization header of each chat request ("" when none)."""
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/info", self.info),
                Route("/generate_stream", self.generate_stream, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def info(self, request: Request) -> Response:
        return JSONResponse({"model_id": "fake-model", "model_dtype": "bfloat16"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def _reject(self, text: str, body: dict[str, Any] | None = None) -> Response | None:
        if "FAIL" in text:
            return JSONResponse({"error": "bad input", "error_type": "validation"}, 422)
        if self.transformers_serve and body is not None and "ignore_eos" in body:
            return JSONResponse({"error": "unexpected field ignore_eos"}, 422)
        return None

    async def _openai_tail(self, n: int) -> AsyncIterator[str]:
        if self.transformers_serve:
            return
        yield _sse({"choices": [], "usage": self._usage(n)})
        yield _sse("[DONE]")

    def _stream(self, events: AsyncIterator[str]) -> Response:
        return StreamingResponse(events, media_type="text/event-stream")

    async def _tokens(self, n: int, cut: bool) -> AsyncIterator[int]:
        for i in range(n // 2 if cut else n):
            await asyncio.sleep(self.token_delay_s)
            yield i

    async def generate_stream(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        n = body["parameters"]["max_new_tokens"]
        if (error := self._reject(body["inputs"])) is not None:
            return error

        async def events() -> AsyncIterator[str]:
            async for i in self._tokens(n, "CUT" in body["inputs"]):
                last = i == n - 1
                yield _sse(
                    {
                        "index": i,
                        "token": {"id": i, "text": f" t{i}", "logprob": -0.5, "special": False},
                        "generated_text": "".join(f" t{j}" for j in range(n)) if last else None,
                        "details": {"finish_reason": "length", "generated_tokens": n, "seed": None}
                        if last
                        else None,
                    }
                )

        return self._stream(events())

    def _usage(self, n: int) -> dict[str, Any]:
        return {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        n = body["max_tokens"]
        if (error := self._reject(body["prompt"], body)) is not None:
            return error

        async def events() -> AsyncIterator[str]:
            cut = "CUT" in body["prompt"]
            async for i in self._tokens(n, cut):
                finish = "length" if i == n - 1 else None
                yield _sse({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}]})
            if cut:
                return
            async for event in self._openai_tail(n):
                yield event

        return self._stream(events())

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("authorization", ""))
        n = body["max_tokens"]
        text = " ".join(m["content"] for m in body["messages"])
        if (error := self._reject(text, body)) is not None:
            return error

        async def events() -> AsyncIterator[str]:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            async for i in self._tokens(n, "CUT" in text):
                yield _sse({"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]})
            if "CUT" in text:
                return
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            async for event in self._openai_tail(n):
                yield event

        return self._stream(events())


class ServerThread:
    """Runs an ASGI app on uvicorn at a free local port in a background thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", ws="none")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeServer]]:
    """(base URL, FakeServer) of a fake streaming server on a free port."""
    fake = FakeServer()
    with ServerThread(fake.app) as running:
        yield running.url, fake
