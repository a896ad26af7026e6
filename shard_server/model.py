"""The interface every shard model implements, and the shared step post-processing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.sampler import Sampler, SamplerOutput, SamplingTensors
from textgate.shard_server.sequence import Sequence, TokenizerInfo


class BatchLike(ABC):
    """What the server needs of a model's batch type (continuous batching)."""

    batch_id: int

    @abstractmethod
    def to_pb(self) -> pb.CachedBatch: ...

    @abstractmethod
    def filter(self, request_ids: Seq[int]) -> Any: ...


B = TypeVar("B")


@dataclass(frozen=True)
class StepOutput(Generic[B]):
    """One step's generations and the batch that keeps running (None if all finished)."""

    generations: list[pb.Generation]
    batch: B | None
    forward_ns: int
    decode_ns: int


class Model(ABC, Generic[B]):
    """A loaded model that turns batches into generations, one token per step."""

    info: TokenizerInfo
    sampler: Sampler

    @abstractmethod
    def describe(self) -> pb.InfoResponse: ...

    @abstractmethod
    def batch_from_pb(self, batch: pb.Batch) -> B: ...

    @abstractmethod
    def concatenate(self, batches: Seq[B]) -> B: ...

    @abstractmethod
    def generate_token(self, batch: B) -> StepOutput[B]: ...

    @abstractmethod
    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Run the largest batch once; report the token capacity if a cache bounds it."""


def sample(
    sampler: Sampler,
    logits: torch.Tensor,
    sequences: Seq[Sequence],
    params: SamplingTensors,
    info: TokenizerInfo,
) -> SamplerOutput:
    """Run the sampler with the penalties and eos suppression the sequences need."""
    counts = _token_counts(sequences, logits) if params.any_penalty else None
    suppress = None
    if any(s.stopping.suppress_eos for s in sequences) and info.eos_token_ids:
        suppress = torch.zeros_like(logits, dtype=torch.bool)
        eos = torch.tensor(sorted(info.eos_token_ids), device=logits.device)
        for row, seq in enumerate(sequences):
            if seq.stopping.suppress_eos:
                suppress[row, eos] = True
    return sampler(logits, params, counts, suppress)


def _token_counts(sequences: Seq[Sequence], logits: torch.Tensor) -> torch.Tensor:
    counts = torch.zeros_like(logits)  # [B, V]
    for row, seq in enumerate(sequences):
        ids = torch.tensor(seq.all_ids, device=logits.device)
        counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts


def append_tokens(
    sequences: Seq[Sequence], result: SamplerOutput, info: TokenizerInfo
) -> tuple[list[pb.Generation], list[int]]:
    """Feed each sequence its sampled token; return the generations and the unfinished ids."""
    generations, running = [], []
    for row, seq in enumerate(sequences):
        top = (result.top_ids[row], result.top_logprobs[row])
        generation, finished = seq.append(result.next_ids[row], result.logprobs[row], top, info)
        generations.append(generation)
        if not finished:
            running.append(seq.id)
    return generations, running
