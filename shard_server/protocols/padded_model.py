"""The padded step protocol: batches cached by id, TGI's Prefill -> Decode -> FilterBatch.

A `PaddedModel` owns its batch cache: a running batch lives here between calls and
only its id travels. Requests join by Decode merging cached batches (`concatenate`)
and leave by FilterBatch or by finishing (`BatchLike.filter`). Subclasses supply the
batch type and one step over it (`generate_token`); the transformers fallback is one.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.protocols.shard_model import (
    PADDED_ONLY,
    BatchNotFound,
    InvalidCall,
    ShardModel,
    UnsupportedCall,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


class BatchLike(Protocol):
    """What the cache needs of a model's batch type."""

    batch_id: int

    def to_pb(self) -> pb.CachedBatch: ...

    def filter(self, request_ids: Seq[int]) -> Self | None:
        """Keep only `request_ids` (in batch order); None when nothing is left."""
        ...


B = TypeVar("B", bound=BatchLike)


@dataclass(frozen=True)
class StepOutput(Generic[B]):
    """One step's generations and the batch that keeps running (None if all finished)."""

    generations: list[pb.Generation]
    batch: B | None
    forward_ns: int
    decode_ns: int


class PaddedModel(ShardModel, Generic[B]):
    """A model stepping whole batches, with the cache of running batches by id."""

    def __init__(self) -> None:
        self.batches: dict[int, B] = {}

    @abstractmethod
    def batch_from_pb(self, batch: pb.Batch) -> B:
        """A new batch, ready for its prefill step."""

    @abstractmethod
    def concatenate(self, batches: Seq[B]) -> B:
        """Merge decode-ready batches into one that keeps the first batch's id."""

    @abstractmethod
    def generate_token(self, batch: B) -> StepOutput[B]:
        """One forward pass and one sampled token per request; finished ones leave."""

    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """One prefill and one decode of the router's largest batch; the batch is dropped."""
        self.batches.clear()
        step = self.generate_token(self.batch_from_pb(request.batch))
        if step.batch is not None:
            self.generate_token(step.batch)
        return pb.WarmupResponse()

    def clear(self, batch_id: int | None) -> None:
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    def filter(self, batch_id: int, request_ids: Seq[int]) -> pb.CachedBatch:
        kept = self._pop([batch_id])[0].filter(request_ids)
        if kept is None:
            return pb.CachedBatch(id=batch_id)
        return self._keep(kept)

    def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        if not batch.requests:
            raise InvalidCall("Prefill needs a batch with at least one request")
        out = self.generate_token(self.batch_from_pb(batch))
        response = pb.PrefillResponse(
            generations=out.generations, forward_ns=out.forward_ns, decode_ns=out.decode_ns
        )
        if out.batch is not None:
            response.batch.CopyFrom(self._keep(out.batch))
        return response

    def decode(self, batches: Seq[pb.CachedBatch]) -> pb.DecodeResponse:
        if not batches:
            raise InvalidCall("Decode needs at least one cached batch")
        start = time.perf_counter_ns()
        merged = self.concatenate(self._pop([b.id for b in batches]))
        concat_ns = time.perf_counter_ns() - start
        out = self.generate_token(merged)
        response = pb.DecodeResponse(
            generations=out.generations,
            forward_ns=out.forward_ns,
            decode_ns=out.decode_ns,
            concat_ns=concat_ns,
        )
        if out.batch is not None:
            response.batch.CopyFrom(self._keep(out.batch))
        return response

    def step(self, requests: Seq[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        raise UnsupportedCall(PADDED_ONLY)

    def _pop(self, batch_ids: Seq[int]) -> list[B]:
        """Take batches out of the cache; none is taken unless all are there."""
        missing = [i for i in batch_ids if i not in self.batches]
        if missing:
            raise BatchNotFound(f"batch {missing[0]} not found")
        return [self.batches.pop(i) for i in batch_ids]

    def _keep(self, batch: B) -> pb.CachedBatch:
        self.batches[batch.batch_id] = batch
        return batch.to_pb()
