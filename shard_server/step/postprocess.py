"""After the forward pass, shared by both step protocols: sample each row, feed each sequence.

`sample` adds what the sequences ask of the sampler (penalty counts, eos suppression,
grammar masks); `append_tokens` hands each sequence its token and collects the
`Generation`s.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.grammar import GrammarMasks
from textgate.shard_server.step.sampler import Sampler, SamplerOutput, SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo


def sample(
    sampler: Sampler,
    logits: torch.Tensor,
    sequences: Seq[Sequence],
    params: SamplingTensors,
    info: TokenizerInfo,
    grammar: GrammarMasks | None = None,
) -> SamplerOutput:
    """Run the sampler with the penalties, eos suppression and grammar masks the
    sequences need."""
    counts = _token_counts(sequences, logits) if params.any_penalty else None
    suppress = None
    if any(s.stopping.suppress_eos for s in sequences):
        suppress = torch.zeros_like(logits, dtype=torch.bool)
        for row, seq in enumerate(sequences):
            ends = info.eos_token_ids | seq.stopping.stop_token_ids
            if seq.stopping.suppress_eos and ends:
                suppress[row, torch.tensor(sorted(ends), device=logits.device)] = True
    return sampler(logits, params, counts, suppress, grammar)


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
