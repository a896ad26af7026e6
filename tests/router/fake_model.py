"""The fake shard's toy model: its tokenizer, and the one token rule both step protocols share.

Every step emits token id = previous id + 1 (the first follows the last prompt id),
with text f" t{id}". Requests finish at max_new_tokens (length), when the generated
text ends with a stop sequence, or, with `eos_after=N`, on the end-of-sequence token
that follows N ordinary tokens. The first token carries the prompt's logprobs when the
request asks for them.

`FakeTokenizer` is the matching tokenizer: one id per whitespace-separated word,
"wN" or "tN" -> N.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from textgate.proto import generate_pb2 as pb

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
class FakeSequence:
    """One request's generation state in a fake shard."""

    request: pb.Request
    last_id: int
    ids: list[int] = field(default_factory=list)
    """Generated token ids."""
    text: str = ""
    """Generated text, EOS excluded."""

    @classmethod
    def from_pb(cls, request: pb.Request) -> FakeSequence:
        return cls(request, request.input_ids[-1] if request.input_ids else 0)

    @property
    def known_ids(self) -> list[int]:
        """Prompt and generated ids: the tokens a paged step may compute."""
        return [*self.request.input_ids, *self.ids]


def next_generation(seq: FakeSequence, eos_after: int | None) -> pb.Generation:
    """Generate `seq`'s next token; `generated_text` is set when the request finishes."""
    request = seq.request
    stopping = request.stopping_parameters
    first = not seq.ids
    is_eos = (
        eos_after is not None
        and len(seq.ids) >= eos_after
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
        top_tokens=[_top_tokens(token_id, request.top_n_tokens)] if request.top_n_tokens else [],
    )
    if first and request.prefill_logprobs:
        generation.prefill_tokens.CopyFrom(_prefill_tokens(request))
    reason = _finish_reason(seq, is_eos)
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


def _finish_reason(seq: FakeSequence, is_eos: bool) -> int | None:
    stopping = seq.request.stopping_parameters
    if is_eos:
        return pb.FINISH_REASON_EOS_TOKEN
    if any(seq.text.endswith(stop) for stop in stopping.stop_sequences):
        return pb.FINISH_REASON_STOP_SEQUENCE
    if len(seq.ids) >= stopping.max_new_tokens:
        return pb.FINISH_REASON_LENGTH
    return None


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


def plan_error(seq: FakeSequence, item: pb.ScheduledRequest, block_size: int) -> str | None:
    """What is wrong with a paged step's share for `seq` (None if nothing): the checks a
    real shard cannot afford, so router tests against the fake catch planning bugs."""
    start, end = item.start_position, item.start_position + len(item.token_ids)
    known = seq.known_ids
    if list(item.token_ids) != known[start:end]:
        return f"request {seq.request.id}: token_ids at [{start}, {end}) are not its tokens"
    if item.produces_token and end != len(known):
        return f"request {seq.request.id}: samples at {end} but has {len(known)} known tokens"
    if len(item.block_table) * block_size < end:
        return f"request {seq.request.id}: {len(item.block_table)} blocks hold < {end} tokens"
    return None
