"""The interface the shard's servicer talks to, and its errors.

A shard serves ONE step protocol of generate.proto. `PaddedModel` (padded_model.py)
serves Prefill / Decode / FilterBatch over batches it caches by id; `PagedModel`
(paged_model.py) serves Step over the paged KV cache. Each answers the other
protocol's calls with `UnsupportedCall`, so the servicer never asks which it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.sequence import TokenizerInfo


class InvalidCall(Exception):
    """A call that cannot be served as sent (gRPC INVALID_ARGUMENT); the message says why."""


class UnsupportedCall(InvalidCall):
    """A call of the step protocol this shard does not serve; the message names its own."""


class BatchNotFound(LookupError):
    """A batch id the shard has not cached (gRPC NOT_FOUND)."""


PAGED_ONLY = "this shard is paged (block_size > 0): send Step, not {call}"
PADDED_ONLY = "this shard is padded (block_size 0): send Prefill / Decode / FilterBatch, not Step"


class ShardModel(ABC):
    """A loaded model behind generate.proto: one call at a time, from the model thread.

    Responses leave `total_ns` to the servicer, which times the whole call.
    """

    info: TokenizerInfo

    @abstractmethod
    def describe(self) -> pb.InfoResponse:
        """Info: the model facts the router validates and tokenizes with."""

    @abstractmethod
    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Drop all state, run the largest step the limits allow once, report capacity."""

    @abstractmethod
    def clear(self, batch_id: int | None) -> None:
        """ClearCache: drop one cached batch, or all state when `batch_id` is None."""

    @abstractmethod
    def filter(self, batch_id: int, request_ids: Seq[int]) -> pb.CachedBatch:
        """Padded: keep only `request_ids` of a cached batch (BatchNotFound if unknown)."""

    @abstractmethod
    def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        """Padded: compute a new batch's prompts, sample its first tokens, cache it."""

    @abstractmethod
    def decode(self, batches: Seq[pb.CachedBatch]) -> pb.DecodeResponse:
        """Padded: merge cached batches (first id wins) and sample one token for each."""

    @abstractmethod
    def step(self, requests: Seq[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        """Paged: admit `requests`, drop `plan.finished_ids`, run the plan, sample."""
