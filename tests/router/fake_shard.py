"""A fake model shard: the real gRPC service on a unix socket, a deterministic toy model.

Every step emits token id = previous id + 1 (the first follows the last prompt id),
with text f" t{id}". Requests finish at max_new_tokens (length), when the generated
text ends with a stop sequence, or, with `eos_after=N`, on the end-of-sequence token
that follows N ordinary tokens. Batches live in a cache by id and merge in Decode
like a real shard's. Tests reuse it to drive the router without torch:

    async with fake_shards(tmp_path / "s", world_size=2) as shards:
        shards[0].step_delay_s = 0.01
        client = await ShardedClient.connect(str(tmp_path / "s"))

`FakeTokenizer` is the matching tokenizer: one id per whitespace-separated word,
"wN" or "tN" -> N.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from textgate.proto import generate_pb2 as pb
from textgate.proto import generate_pb2_grpc as pb_grpc

EOS_TOKEN_ID = 2
EOS_TEXT = "</s>"
VOCAB_SIZE = 1000
_WORD = re.compile(r"^[wt](\d+)$")


class FakeTokenizer:
    """Whitespace words to ids: "wN"/"tN" -> N, anything else -> 3 + len(word).

    Called like a transformers fast tokenizer with `return_offsets_mapping=True`, it
    also gives each word's character span.
    """

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [_word_id(match.group()) for match in re.finditer(r"\S+", text)]

    def __len__(self) -> int:
        return VOCAB_SIZE

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{token_id}" for token_id in ids)

    def __call__(
        self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False
    ) -> dict[str, list[Any]]:
        matches = list(re.finditer(r"\S+", text))
        encoding: dict[str, list[Any]] = {"input_ids": [_word_id(m.group()) for m in matches]}
        if return_offsets_mapping:
            encoding["offset_mapping"] = [m.span() for m in matches]
        return encoding


def _word_id(word: str) -> int:
    match = _WORD.match(word)
    return int(match.group(1)) if match else 3 + len(word)


@dataclass
class _Sequence:
    request: pb.Request
    last_id: int
    ids: list[int] = field(default_factory=list)
    text: str = ""


class FakeShard(pb_grpc.TextGenerationServiceServicer):
    """The servicer; tweak its attributes to change the model or inject failures."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.cache: dict[int, list[_Sequence]] = {}
        self.calls: list[tuple[str, Any]] = []
        """(method, request) of every call, in order."""
        self.step_delay_s = 0.0
        """Sleep in every Prefill/Decode, so requests can arrive mid-generation."""
        self.eos_after: int | None = None
        """Emit the EOS token after this many ordinary tokens."""
        self.fail: dict[str, int] = {}
        """Method name -> number of upcoming calls that fail with INTERNAL."""
        self.healthy = True
        self.max_supported_total_tokens: int | None = None
        """What Warmup reports; None leaves the field unset."""
        self.block_size = 0
        """What Info reports; > 0 pretends to be a paged shard."""

    def calls_to(self, method: str) -> list[Any]:
        return [request for name, request in self.calls if name == method]

    async def _enter(self, method: str, request: Any, context: Any) -> None:
        self.calls.append((method, request))
        if self.fail.get(method, 0) > 0:
            self.fail[method] -= 1
            await context.abort(grpc.StatusCode.INTERNAL, f"fake {method} failure")

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoResponse:
        await self._enter("Info", request, context)
        return pb.InfoResponse(
            requires_padding=False,
            block_size=self.block_size,
            dtype="float32",
            device_type="cpu",
            max_position_embeddings=4096,
            model_id="fake",
            model_type="fake",
            world_size=len(self.urls),
        )

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        await self._enter("Health", request, context)
        if not self.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake shard is unhealthy")
        return pb.HealthResponse()

    async def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: Any
    ) -> pb.ServiceDiscoveryResponse:
        await self._enter("ServiceDiscovery", request, context)
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(
        self, request: pb.ClearCacheRequest, context: Any
    ) -> pb.ClearCacheResponse:
        await self._enter("ClearCache", request, context)
        if request.HasField("id"):
            self.cache.pop(request.id, None)
        else:
            self.cache.clear()
        return pb.ClearCacheResponse()

    async def FilterBatch(
        self, request: pb.FilterBatchRequest, context: Any
    ) -> pb.FilterBatchResponse:
        await self._enter("FilterBatch", request, context)
        sequences = await self._pop(request.batch_id, context)
        keep = set(request.request_ids)
        sequences = [s for s in sequences if s.request.id in keep]
        self.cache[request.batch_id] = sequences
        return pb.FilterBatchResponse(batch=_cached(request.batch_id, sequences))

    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        await self._enter("Warmup", request, context)
        return pb.WarmupResponse(max_supported_total_tokens=self.max_supported_total_tokens)

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        await self._enter("Prefill", request, context)
        await asyncio.sleep(self.step_delay_s)
        sequences = [
            _Sequence(r, r.input_ids[-1] if r.input_ids else 0) for r in request.batch.requests
        ]
        generations = [self._step(s, prefill=True) for s in sequences]
        return self._respond(pb.PrefillResponse, request.batch.id, sequences, generations)

    async def Decode(self, request: pb.DecodeRequest, context: Any) -> pb.DecodeResponse:
        await self._enter("Decode", request, context)
        await asyncio.sleep(self.step_delay_s)
        if not request.batches:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no batches")
        sequences = []
        for batch in request.batches:
            sequences += await self._pop(batch.id, context)
        generations = [self._step(s, prefill=False) for s in sequences]
        return self._respond(pb.DecodeResponse, request.batches[0].id, sequences, generations)

    def _respond(
        self, kind: Any, batch_id: int, sequences: list[_Sequence], generations: list[Any]
    ) -> Any:
        running = [
            s
            for s, g in zip(sequences, generations, strict=True)
            if not g.HasField("generated_text")
        ]
        response = kind(generations=generations)
        if running:
            self.cache[batch_id] = running
            response.batch.CopyFrom(_cached(batch_id, running))
        return response

    async def _pop(self, batch_id: int, context: Any) -> list[_Sequence]:
        if batch_id not in self.cache:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"batch {batch_id} not found")
        return self.cache.pop(batch_id)

    def _step(self, seq: _Sequence, *, prefill: bool) -> pb.Generation:
        request = seq.request
        stopping = request.stopping_parameters
        is_eos = (
            self.eos_after is not None
            and len(seq.ids) >= self.eos_after
            and len(seq.ids) >= stopping.min_new_tokens
            and not stopping.ignore_eos_token
        )
        token_id = EOS_TOKEN_ID if is_eos else seq.last_id + 1
        text = EOS_TEXT if is_eos else f" t{token_id}"
        seq.ids.append(token_id)
        seq.last_id = token_id
        if not is_eos:
            seq.text += text
        generation = pb.Generation(
            request_id=request.id,
            tokens=pb.Tokens(
                ids=[token_id], logprobs=[_logprob(request)], texts=[text], is_special=[is_eos]
            ),
            top_tokens=[_top_tokens(token_id, request.top_n_tokens)]
            if request.top_n_tokens
            else [],
        )
        if prefill and request.prefill_logprobs:
            generation.prefill_tokens.CopyFrom(_prefill_tokens(request))
        reason = self._finish_reason(seq, is_eos)
        if reason is not None:
            generation.generated_text.CopyFrom(
                pb.GeneratedText(
                    text=seq.text,
                    generated_tokens=len(seq.ids),
                    finish_reason=reason,
                    seed=request.parameters.seed if request.parameters.do_sample else None,
                )
            )
        return generation

    @staticmethod
    def _finish_reason(seq: _Sequence, is_eos: bool) -> int | None:
        stopping = seq.request.stopping_parameters
        if is_eos:
            return pb.FINISH_REASON_EOS_TOKEN
        if any(seq.text.endswith(stop) for stop in stopping.stop_sequences):
            return pb.FINISH_REASON_STOP_SEQUENCE
        if len(seq.ids) >= stopping.max_new_tokens:
            return pb.FINISH_REASON_LENGTH
        return None


def _cached(batch_id: int, sequences: list[_Sequence]) -> pb.CachedBatch:
    return pb.CachedBatch(
        id=batch_id,
        request_ids=[s.request.id for s in sequences],
        size=len(sequences),
        max_tokens=sum(
            len(s.request.input_ids) + s.request.stopping_parameters.max_new_tokens
            for s in sequences
        ),
    )


def _logprob(request: pb.Request) -> float:
    """Greedy: a constant; sampled: depends on the seed, so best_of has a clear winner."""
    if not request.parameters.do_sample:
        return -0.5
    return -((request.parameters.seed % 97) + 1) / 100


def _top_tokens(token_id: int, n: int) -> pb.Tokens:
    ids = [token_id + k for k in range(n)]
    return pb.Tokens(
        ids=ids,
        logprobs=[-0.5 - k for k in range(n)],
        texts=[f" t{i}" for i in ids],
        is_special=[False] * n,
    )


def _prefill_tokens(request: pb.Request) -> pb.Tokens:
    ids = list(request.input_ids)
    return pb.Tokens(
        ids=ids,
        logprobs=[math.nan] + [-1.0] * (len(ids) - 1),
        texts=[f" t{i}" for i in ids],
        is_special=[False] * len(ids),
    )


@asynccontextmanager
async def fake_shards(uds_path: str, world_size: int = 1) -> AsyncIterator[list[FakeShard]]:
    """Serve `world_size` fake shards on unix://{uds_path}-{rank}; yields their servicers."""
    urls = [f"unix://{uds_path}-{rank}" for rank in range(world_size)]
    servers = []
    shards = []
    try:
        for url in urls:
            shard = FakeShard(urls)
            server = grpc.aio.server()
            pb_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
            server.add_insecure_port(url)
            await server.start()
            servers.append(server)
            shards.append(shard)
        yield shards
    finally:
        await asyncio.gather(*(server.stop(grace=None) for server in servers))
