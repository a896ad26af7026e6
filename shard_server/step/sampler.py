"""Choose the next token for a whole batch at once, each request with its own parameters.

Per-request parameters live in tensors (`SamplingTensors`), so a batch mixing greedy and
sampled requests with different temperatures, top-k/p, typical-p and penalties runs in
one pass. Follows TGI's semantics: a request samples when `do_sample` is set or any
warper (temperature != 1, top_k, top_p < 1, typical_p < 1) is active; otherwise greedy.
vLLM's min_p filters a sampled row and never makes a row sample (argmax always stays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.grammar import GrammarMasks

if TYPE_CHECKING:
    from textgate.shard_server.step.sequence import Sequence as Seq


@dataclass(frozen=True)
class SamplingTensors:
    """The batch's sampling parameters, one row per request."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    typical_p: torch.Tensor  # [B] float32, 1.0 = off
    min_p: torch.Tensor  # [B] float32, 0.0 = off
    repetition_penalty: torch.Tensor  # [B] float32, 1.0 = off
    frequency_penalty: torch.Tensor  # [B] float32, 0.0 = off
    presence_penalty: torch.Tensor  # [B] float32, 0.0 = off
    logit_bias: list[dict[int, float]]  # per row, token id -> added to its logit
    do_sample: list[bool]  # per row: sample (True) or argmax
    penalized: list[bool]  # per row: a repetition, frequency or presence penalty is set
    generators: list[torch.Generator]  # per row, seeded from the request
    top_n: int  # most top-n alternatives any row asks for

    @property
    def any_penalty(self) -> bool:
        # Read from host-side flags: no device sync.
        return any(self.penalized)

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Seq],
        device: torch.device,
        offsets: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """The parameters of `sequences`, row by row; generators stay owned by the sequences.
        `offsets[r]`: row r draws the sequence's token that many after its next one (a row
        verifying speculation's drafts); default 0 for every row."""
        params = [s.request.parameters for s in sequences]
        offsets = offsets if offsets is not None else [0] * len(sequences)

        def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column([p.temperature or 1.0 for p in params]),
            top_k=column([p.top_k for p in params], torch.int64),
            top_p=column([p.top_p or 1.0 for p in params]),
            typical_p=column([p.typical_p or 1.0 for p in params]),
            min_p=column([p.min_p for p in params]),
            repetition_penalty=column([p.repetition_penalty or 1.0 for p in params]),
            frequency_penalty=column([p.frequency_penalty for p in params]),
            presence_penalty=column([p.presence_penalty for p in params]),
            logit_bias=[dict(p.logit_bias) for p in params],
            do_sample=[_samples(p) for p in params],
            penalized=[
                (p.repetition_penalty or 1.0) != 1.0
                or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0
                for p in params
            ],
            generators=[
                s.sampling_generator(offset) for s, offset in zip(sequences, offsets, strict=True)
            ],
            top_n=max((s.request.top_n_tokens for s in sequences), default=0),
        )

    def select(self, rows: list[int]) -> SamplingTensors:
        """The parameters of the kept rows, in the given order (batch filtering)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.temperature.device)
        return SamplingTensors(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            typical_p=self.typical_p[index],
            min_p=self.min_p[index],
            repetition_penalty=self.repetition_penalty[index],
            frequency_penalty=self.frequency_penalty[index],
            presence_penalty=self.presence_penalty[index],
            logit_bias=[self.logit_bias[r] for r in rows],
            do_sample=[self.do_sample[r] for r in rows],
            penalized=[self.penalized[r] for r in rows],
            generators=[self.generators[r] for r in rows],
            top_n=self.top_n,
        )

    @classmethod
    def concatenate(cls, parts: Sequence[SamplingTensors]) -> SamplingTensors:
        return cls(
            temperature=torch.cat([p.temperature for p in parts]),
            top_k=torch.cat([p.top_k for p in parts]),
            top_p=torch.cat([p.top_p for p in parts]),
            typical_p=torch.cat([p.typical_p for p in parts]),
            min_p=torch.cat([p.min_p for p in parts]),
            repetition_penalty=torch.cat([p.repetition_penalty for p in parts]),
            frequency_penalty=torch.cat([p.frequency_penalty for p in parts]),
            presence_penalty=torch.cat([p.presence_penalty for p in parts]),
            logit_bias=[bias for p in parts for bias in p.logit_bias],
            do_sample=[s for p in parts for s in p.do_sample],
            penalized=[s for p in parts for s in p.penalized],
            generators=[g for p in parts for g in p.generators],
            top_n=max(p.top_n for p in parts),
        )


def _samples(p: pb.NextTokenChooserParameters) -> bool:
    has_warpers = (
        (p.temperature or 1.0) != 1.0
        or p.top_k != 0
        or (p.top_p or 1.0) < 1.0
        or (p.typical_p or 1.0) < 1.0
    )
    return p.do_sample or has_warpers


@dataclass(frozen=True)
class SamplerOutput:
    """Host-side results of one sampling pass (one host sync produced all of them)."""

    next_ids: list[int]  # [B]
    logprobs: list[float]  # [B] logprob of the chosen token
    top_ids: list[list[int]]  # [B][top_n]
    top_logprobs: list[list[float]]  # [B][top_n]


class Sampler:
    """Penalties -> warpers -> greedy/sampled choice -> logprobs, for a batch of rows."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: SamplingTensors,
        token_counts: torch.Tensor | None = None,
        suppress_ids: torch.Tensor | None = None,
        grammar: GrammarMasks | None = None,
    ) -> SamplerOutput:
        """Choose one token per row.

        logits: [B, V] float32. token_counts: [B, V] occurrences of each token in the
        request so far (prompt + generated), needed only when a penalty is active.
        suppress_ids: [B, V] bool, tokens that must not be chosen (eos before min_new_tokens).
        grammar: the token masks of the rows with a grammar (structured output); the
        others are left as they are.
        """
        logits = logits.float()
        if any(params.logit_bias):
            logits = apply_logit_bias(logits, params.logit_bias)
        if token_counts is not None and params.any_penalty:
            logits = apply_penalties(logits, token_counts, params)
        if suppress_ids is not None:
            logits = logits.masked_fill(suppress_ids, float("-inf"))
        if grammar is not None:
            # Before the warpers: top-k/top-p choose among the tokens the grammar allows.
            logits = grammar.apply(logits, params.do_sample)
        warped = apply_warpers(logits, params) if any(params.do_sample) else logits
        logprobs = torch.log_softmax(warped, dim=-1)  # [B, V]
        next_ids = logprobs.argmax(dim=-1, keepdim=True)  # [B, 1]
        for row, sample in enumerate(params.do_sample):
            if sample:
                next_ids[row] = _sample_row(logprobs[row], params.generators[row])
        columns = [next_ids, logprobs.gather(1, next_ids)]  # [B, 1] each
        if params.top_n > 0:
            top_logprobs, top_ids = logprobs.topk(params.top_n, dim=-1)  # [B, top_n]
            columns += [top_ids, top_logprobs]
        # One host transfer for all results (float64 holds every token id exactly).
        table = torch.cat([c.double() for c in columns], dim=1).tolist()  # [B, 2 + 2 top_n]
        n = params.top_n
        return SamplerOutput(
            next_ids=[int(row[0]) for row in table],
            logprobs=[row[1] for row in table],
            top_ids=[[int(i) for i in row[2 : 2 + n]] for row in table],
            top_logprobs=[row[2 + n :] for row in table],
        )


def _sample_row(logprobs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using only this
    # request's generator, so a seeded request samples the same alone or in a batch.
    noise = torch.empty_like(logprobs).exponential_(generator=generator)
    return (logprobs.exp() / noise).argmax()


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float]]) -> torch.Tensor:
    """logits [B, V] plus each row's bias; ids past V (a model whose tokenizer is larger
    than its vocabulary) are left out."""
    vocab = logits.shape[1]
    entries = [
        (row, token_id, value)
        for row, bias in enumerate(logit_bias)
        for token_id, value in bias.items()
        if token_id < vocab
    ]
    if not entries:
        return logits
    rows, cols, values = zip(*entries, strict=True)
    index = (
        torch.tensor(rows, device=logits.device),
        torch.tensor(cols, device=logits.device),
    )
    return logits.index_put(index, torch.tensor(values, device=logits.device), accumulate=True)


def apply_penalties(
    logits: torch.Tensor, token_counts: torch.Tensor, params: SamplingTensors
) -> torch.Tensor:
    """CTRL repetition penalty and OpenAI-style frequency and presence penalties
    (logits - frequency * count - presence * [count > 0]). logits, counts: [B, V]."""
    seen = token_counts > 0
    rep = params.repetition_penalty[:, None]  # [B, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - params.frequency_penalty[:, None] * token_counts.to(logits.dtype)
    return logits - params.presence_penalty[:, None] * seen.to(logits.dtype)


def apply_warpers(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p and typical-p; neutral values leave a row unchanged."""
    logits = logits / params.temperature[:, None]
    if bool((params.min_p > 0.0).any()):
        logits = _min_p(logits, params.min_p)
    if bool((params.top_k > 0).any()) or bool((params.top_p < 1.0).any()):
        logits = _top_k_top_p(logits, params.top_k, params.top_p)
    if bool((params.typical_p < 1.0).any()):
        logits = _typical(logits, params.typical_p)
    return logits


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the likeliest (which always stays)."""
    probs = logits.softmax(dim=-1)  # [B, V]
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None]  # [B, 1]
    remove = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
    # before it already does. The first token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _typical(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    logprobs = logits.log_softmax(dim=-1)  # [B, V]
    probs = logprobs.exp()
    entropy = -(probs * logprobs).nan_to_num().sum(dim=-1, keepdim=True)  # [B, 1]
    surprise_gap = (entropy + logprobs).abs()
    _, order = surprise_gap.sort(dim=-1)
    sorted_probs = probs.gather(1, order)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove = mass_before >= typical_p[:, None]
    remove[:, 0] = False
    remove_unsorted = torch.zeros_like(remove).scatter_(1, order, remove)
    return logits.masked_fill(remove_unsorted, float("-inf"))
