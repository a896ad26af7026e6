"""After the forward pass, shared by both step protocols: sample each row, feed each sequence.

`sample` adds what the sequences ask of the sampler (penalty counts, eos suppression,
grammar masks); `append_tokens` hands each sequence its tokens and collects the
`Generation`s.

Speculative decoding (docs/speculative.md): a sequence verifying k drafts has k + 1 rows
(`SampleRows`), row i scored after the first i drafts; each row is processed as a plain step
at that point would be (penalties counting the drafts before it, eos suppression at its
token's index, the generator of its token's index) and sampled. `append_tokens` then walks
the rows: a sampled token equal to the next draft accepts it and the walk goes on; the
first that differs, or the row after the last draft, is the sequence's own token and ends
it. The token after an accepted prefix is thus drawn from exactly the distribution a plain
step would draw it from, with the same noise: greedy and seeded output are the same token
for token with speculation or without, and for any seed the output distribution is the
model's. For a one-token draft x this is the rejection rule of speculative sampling
(Leviathan et al., 2023): x is accepted with probability p(x), and a rejected row's token
is a draw from p without x, renormalised. Stops (eos, stop sequences, max_new_tokens) are
checked token by token, so a stop among accepted drafts ends the sequence there.

Under a grammar each row is masked from the sequence's state after the drafts before it
(shard_server/step/grammar.py), so a draft the grammar forbids is never sampled, hence
never accepted; the walk also stops at the last row the masks verified, and the sequence's
state becomes that of the row its last token came from.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.grammar import GrammarMasks, GrammarState
from textgate.shard_server.step.sampler import Sampler, SamplerOutput, SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo


@dataclass(frozen=True)
class SampleRows:
    """The sampler's rows of one step: one per sampling sequence, k + 1 for one verifying
    k drafts."""

    sequences: list[Sequence]  # [R] each row's sequence
    offsets: list[int]  # [R] how many of its drafts come before the row's token
    conditioned: list[tuple[int, ...]]  # [R] those drafts

    @classmethod
    def expand(cls, sampled: Seq[Sequence], drafts: Seq[tuple[int, ...]]) -> SampleRows:
        sequences, offsets, conditioned = [], [], []
        for seq, seq_drafts in zip(sampled, drafts, strict=True):
            for offset in range(len(seq_drafts) + 1):
                sequences.append(seq)
                offsets.append(offset)
                conditioned.append(seq_drafts[:offset])
        return cls(sequences, offsets, conditioned)


def sample(
    sampler: Sampler,
    logits: torch.Tensor,
    sequences: Seq[Sequence],
    params: SamplingTensors,
    info: TokenizerInfo,
    grammar: GrammarMasks | None = None,
    conditioned: Seq[tuple[int, ...]] | None = None,
) -> SamplerOutput:
    """Run the sampler with the penalties, eos suppression and grammar masks the
    sequences need; `conditioned[r]`: the drafts row r's token follows (speculation)."""
    after = conditioned if conditioned is not None else [()] * len(sequences)
    counts = _token_counts(sequences, after, logits) if params.any_penalty else None
    suppress = None
    if any(s.stopping.suppresses_eos(len(a)) for s, a in zip(sequences, after, strict=True)):
        suppress = torch.zeros_like(logits, dtype=torch.bool)
        for row, (seq, drafts) in enumerate(zip(sequences, after, strict=True)):
            ends = info.eos_token_ids | seq.stopping.stop_token_ids
            if seq.stopping.suppresses_eos(len(drafts)) and ends:
                suppress[row, torch.tensor(sorted(ends), device=logits.device)] = True
    return sampler(logits, params, counts, suppress, grammar)


def _token_counts(
    sequences: Seq[Sequence], after: Seq[tuple[int, ...]], logits: torch.Tensor
) -> torch.Tensor:
    counts = torch.zeros_like(logits)  # [B, V]
    for row, (seq, drafts) in enumerate(zip(sequences, after, strict=True)):
        ids = torch.tensor(seq.all_ids + list(drafts), device=logits.device)
        counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts


def append_tokens(
    sequences: Seq[Sequence],
    result: SamplerOutput,
    info: TokenizerInfo,
    drafts: Seq[tuple[int, ...]] | None = None,
    grammar: GrammarMasks | None = None,
) -> tuple[list[pb.Generation], list[int]]:
    """Feed each sequence its sampled tokens (its accepted drafts, then its own token);
    return one generation per sequence and the unfinished ids. `grammar`: the masks the
    rows were sampled with (a sequence with a grammar verifies only the rows they masked)."""
    generations, running = [], []
    states = grammar.by_row() if grammar is not None else {}
    row = 0
    for index, seq in enumerate(sequences):
        seq_drafts = drafts[index] if drafts is not None else ()
        generation, finished, num_rows = _append_run(seq, seq_drafts, result, row, info, states)
        row += num_rows
        generations.append(generation)
        if not finished:
            running.append(seq.id)
    return generations, running


def _append_run(
    seq: Sequence,
    drafts: tuple[int, ...],
    result: SamplerOutput,
    row: int,
    info: TokenizerInfo,
    states: dict[int, GrammarState],
) -> tuple[pb.Generation, bool, int]:
    """Append the sequence's tokens from its rows starting at `row`, until one differs from
    its draft, one stops the sequence, or the verified rows end; (generation, finished,
    rows used)."""
    generation: pb.Generation | None = None
    finished = False
    last = _num_verified(seq, len(drafts), row, states)
    for offset in range(last + 1):
        r = row + offset
        if offset and seq.grammar is not None:
            # The row's state is the sequence's after the drafts accepted so far.
            seq.grammar = states[r]
        token = result.next_ids[r]
        top = (result.top_ids[r], result.top_logprobs[r])
        step, finished = seq.append(token, result.logprobs[r], top, info)
        generation = step if generation is None else _joined(generation, step)
        if finished or offset == last or token != drafts[offset]:
            break
    assert generation is not None
    return generation, finished, len(drafts) + 1


def _num_verified(seq: Sequence, num_drafts: int, row: int, states: dict[int, GrammarState]) -> int:
    """The drafts the sequence's rows from `row` verify: all of them, or under a grammar
    those before the first row its masks left out."""
    if seq.grammar is None:
        return num_drafts
    num = 0
    while num < num_drafts and row + num + 1 in states:
        num += 1
    return num


def _joined(generation: pb.Generation, step: pb.Generation) -> pb.Generation:
    """`generation` with the tokens (and the end, if any) of the next token's `step`."""
    tokens, more = generation.tokens, step.tokens
    tokens.ids.extend(more.ids)
    tokens.logprobs.extend(more.logprobs)
    tokens.texts.extend(more.texts)
    tokens.is_special.extend(more.is_special)
    generation.top_tokens.extend(step.top_tokens)
    if step.HasField("generated_text"):
        generation.generated_text.CopyFrom(step.generated_text)
    return generation
