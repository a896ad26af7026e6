"""One request as a shard sees it: its tokens, stop rules, detokenizer and step outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.detokenizer import IncrementalDetokenizer
from textgate.shard_server.step.grammar import GrammarCompiler, GrammarError, GrammarState
from textgate.shard_server.step.stopping import StoppingCriteria


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer plus the token sets every sequence needs."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    special_ids: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, extra_eos: list[int] | int | None) -> TokenizerInfo:
        eos = set(_as_list(extra_eos))
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(tokenizer, frozenset(eos), frozenset(tokenizer.all_special_ids))

    def texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


def token_seed(seed: int, index: int) -> int:
    """The seed of a request's generated token number `index` (splitmix64 of the pair, so
    neighbouring indexes and seeds draw unrelated noise)."""
    mask = (1 << 64) - 1
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _as_list(value: list[int] | int | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


@dataclass
class Sequence:
    """A request's state between steps; `all_ids` is prompt + generated."""

    request: pb.Request
    all_ids: list[int]
    prompt_len: int
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    # Seeded from the request and the token's index (`sampling_generator`): sampling is
    # reproducible alone or in any batch, with speculation or without.
    generator: torch.Generator
    grammar: GrammarState | None = None
    """Where the text is in the request's grammar (structured output); None: unconstrained."""
    extra_generators: list[torch.Generator] = field(default_factory=list)
    """Speculation: the generators of the rows after the first (one per draft verified)."""

    @classmethod
    def from_pb(
        cls,
        request: pb.Request,
        info: TokenizerInfo,
        device: torch.device | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> Sequence:
        """The request's state before its first token; GrammarError when its grammar does
        not compile (or this shard has no `grammars` to compile it with)."""
        grammar = None
        if request.HasField("grammar"):
            if grammars is None:
                raise GrammarError("grammars need a paged shard (a native model)")
            budget = request.stopping_parameters.max_new_tokens
            grammar = grammars.state(request.grammar, budget)
        ids = list(request.input_ids)
        generator = torch.Generator(device=device or "cpu")
        generator.manual_seed(request.parameters.seed)
        return cls(
            request=request,
            all_ids=ids,
            prompt_len=len(ids),
            stopping=StoppingCriteria.from_pb(request.stopping_parameters, info.eos_token_ids),
            detokenizer=IncrementalDetokenizer.for_prompt(len(ids)),
            generator=generator,
            grammar=grammar,
        )

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def generated_ids(self) -> list[int]:
        return self.all_ids[self.prompt_len :]

    def sampling_generator(self, offset: int = 0) -> torch.Generator:
        """The generator that draws generated token number len(generated_ids) + `offset`,
        seeded from the request's seed and that index alone: a token's draw does not depend
        on how many were drawn before it, so a step verifying drafts (one row per token)
        samples what plain steps would, token for token."""
        if offset == 0:
            generator = self.generator
        else:
            while len(self.extra_generators) < offset:
                self.extra_generators.append(torch.Generator(device=self.generator.device))
            generator = self.extra_generators[offset - 1]
        index = len(self.all_ids) - self.prompt_len + offset
        generator.manual_seed(token_seed(self.request.parameters.seed, index))
        return generator

    @property
    def max_tokens(self) -> int:
        """Prompt plus the generation budget."""
        return self.prompt_len + self.request.stopping_parameters.max_new_tokens

    def append(
        self,
        token_id: int,
        logprob: float,
        top: tuple[list[int], list[float]],
        info: TokenizerInfo,
    ) -> tuple[pb.Generation, bool]:
        """Add one generated token; return its Generation and whether the request finished."""
        self.all_ids.append(token_id)
        text = self.detokenizer.step(info.tokenizer, self.all_ids)
        reason = self.stopping(token_id, text)
        if self.grammar is not None:
            # The mask allowed only tokens the grammar accepts. Its end accepts only
            # end-of-sequence: the text is complete even when the request ignores eos.
            self.grammar.accept(token_id)
            if reason in (None, pb.FINISH_REASON_EOS_TOKEN) and self.grammar.terminated:
                # Text closed early to fit the budget ends as the budget's (`length`).
                reason = (
                    pb.FINISH_REASON_LENGTH
                    if self.grammar.closed_by_budget
                    else pb.FINISH_REASON_EOS_TOKEN
                )
        generation = pb.Generation(
            request_id=self.id,
            tokens=pb.Tokens(
                ids=[token_id],
                logprobs=[logprob],
                texts=[text],
                is_special=[token_id in info.special_ids],
            ),
        )
        top_n = self.request.top_n_tokens
        if top_n:
            ids, logprobs = top[0][:top_n], top[1][:top_n]
            generation.top_tokens.append(
                pb.Tokens(
                    ids=ids,
                    logprobs=logprobs,
                    texts=info.texts(ids),
                    is_special=[i in info.special_ids for i in ids],
                )
            )
        if reason is not None:
            generation.generated_text.CopyFrom(
                pb.GeneratedText(
                    text=info.tokenizer.decode(self.generated_ids, skip_special_tokens=True),
                    generated_tokens=len(self.generated_ids),
                    finish_reason=reason,
                    seed=self.request.parameters.seed,
                )
            )
        return generation, reason is not None

    def prefill_tokens(self, logprobs: list[float], info: TokenizerInfo) -> pb.Tokens:
        """The prompt with each token's logprob given the ones before (the first has none: NaN)."""
        ids = self.all_ids[: self.prompt_len]
        return pb.Tokens(
            ids=ids,
            logprobs=[float("nan"), *logprobs],
            texts=info.texts(ids),
            is_special=[i in info.special_ids for i in ids],
        )
