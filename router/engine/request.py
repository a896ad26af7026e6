"""A request as validation leaves it: tokenized, every parameter resolved to a concrete value."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from textgate.proto import generate_pb2 as pb
from textgate.router.engine.fairness import ANONYMOUS_TENANT


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (TGI defaults; ranges already checked)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    min_p: float = 0.0

    def to_pb(self) -> pb.NextTokenChooserParameters:
        fields = dataclasses.asdict(self)
        fields["logit_bias"] = dict(self.logit_bias)
        return pb.NextTokenChooserParameters(**fields)


@dataclass(frozen=True)
class StoppingParams:
    """When generation stops."""

    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """The request's own end-of-sequence tokens."""

    def to_pb(self) -> pb.StoppingCriteriaParameters:
        return pb.StoppingCriteriaParameters(
            max_new_tokens=self.max_new_tokens,
            stop_sequences=list(self.stop_sequences),
            ignore_eos_token=self.ignore_eos_token,
            min_new_tokens=self.min_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
        )


GrammarKind = Literal["json", "regex", "ebnf"]
_GRAMMAR_TYPES: dict[str, pb.GrammarType] = {
    "json": pb.GRAMMAR_TYPE_JSON,
    "regex": pb.GRAMMAR_TYPE_REGEX,
    "ebnf": pb.GRAMMAR_TYPE_EBNF,
}


@dataclass(frozen=True)
class ThinkingMarkers:
    """How a reasoning model's text marks its thinking, as single token ids."""

    end_token_id: int
    """Ends the thinking."""
    starts_inside: bool
    """The text begins inside the thinking (the prompt opened it)."""
    start_token_id: int | None = None
    """Otherwise the text thinks only when its first token is this one."""

    def to_pb(self) -> pb.ThinkingMarkers:
        return pb.ThinkingMarkers(
            end_token_id=self.end_token_id,
            starts_inside=self.starts_inside,
            start_token_id=self.start_token_id,
        )


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text (structured output), enforced by the shards."""

    kind: GrammarKind
    value: str
    """A JSON schema as JSON text, a regular expression, or an EBNF grammar."""
    thinking: ThinkingMarkers | None = None
    """Set: the text may think first and the grammar applies after the thinking."""

    def to_pb(self) -> pb.Grammar:
        thinking = None if self.thinking is None else self.thinking.to_pb()
        return pb.Grammar(type=_GRAMMAR_TYPES[self.kind], value=self.value, thinking=thinking)


@dataclass(frozen=True)
class ValidRequest:
    """A validated generation request, ready to be queued and sent to the shards."""

    inputs: str
    """The prompt text as the client sent it."""
    input_ids: tuple[int, ...]
    """Prompt token ids, already truncated."""
    sampling: SamplingParams
    stopping: StoppingParams
    top_n_tokens: int = 0
    decoder_input_details: bool = False
    """Ask the shard for the prompt tokens' logprobs."""
    best_of: int = 1
    """Candidates to generate; the response keeps the one with the highest logprob sum."""
    grammar: GrammarSpec | None = None
    """The text must match this grammar; None: unconstrained."""
    adapter_id: str | None = None
    """The LoRA adapter it runs with; None: the base model."""
    skip_special_tokens: bool = True
    """Special tokens add nothing to the text (False: their text is kept)."""
    priority: int = 0
    """Lower is admitted first (vLLM's `priority`); within one priority, first come first."""
    timeout_s: float | None = None
    """Seconds from its arrival it may take: still queued past it, it fails (`timeout`);
    running past it, it ends with what it has (finish reason `length`). None: no deadline."""
    received_at: float | None = None
    """When the server received it (time.monotonic()), where its `timeout_s` starts: the
    time its template, tokenizer and validation took is part of it. None: its admission."""
    tenant: str = ANONYMOUS_TENANT
    """Whose fair share of the scheduler serves it: its API key's tenant, or the anonymous
    one for every request without a key file."""
    tenant_weight: float = 1.0
    """Its tenant's `weight` (the key file's): its share relative to other tenants'."""

    @property
    def input_length(self) -> int:
        return len(self.input_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.stopping.max_new_tokens

    @property
    def max_tokens(self) -> int:
        """Tokens this request may occupy in a batch: prompt plus generation budget."""
        return self.input_length + self.max_new_tokens

    def with_seed(self, seed: int) -> ValidRequest:
        """The same request with another sampling seed (best_of candidates)."""
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, seed=seed))

    def to_pb(self, request_id: int) -> pb.Request:
        return pb.Request(
            id=request_id,
            inputs=self.inputs,
            input_ids=list(self.input_ids),
            parameters=self.sampling.to_pb(),
            stopping_parameters=self.stopping.to_pb(),
            prefill_logprobs=self.decoder_input_details,
            top_n_tokens=self.top_n_tokens,
            grammar=None if self.grammar is None else self.grammar.to_pb(),
            adapter_id=self.adapter_id or "",
        )
