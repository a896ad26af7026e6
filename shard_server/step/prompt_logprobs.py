"""Prompt-token logprobs (`decoder_input_details`), gathered over a prompt's chunks.

A sequence that asks for them has every prompt row's logits computed (not just the last
one); each chunk's logprobs accumulate here until the sequence's first generated token,
whose Generation carries them as `prefill_tokens`. A sequence that also asks for
`top_n_tokens` gets each prompt token's most likely alternatives too
(`prefill_top_tokens`: what OpenAI's completions give for an echoed prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo


def wants_prompt_logprobs(seq: Sequence, start: int) -> bool:
    """Whether the chunk of `seq` starting at position `start` needs all its rows' logits."""
    return seq.request.prefill_logprobs and not seq.generated_ids and start < seq.prompt_len


class PromptLogprobs:
    """Each sequence's prompt logprobs so far, by sequence id."""

    def __init__(self) -> None:
        self._values: dict[int, list[float]] = {}
        # Per sequence, per prompt token after the first: its top-n (ids, logprobs).
        self._top: dict[int, list[tuple[list[int], list[float]]]] = {}

    def record(
        self,
        prefill_rows: Mapping[int, tuple[int, list[int]]],
        sequences: Mapping[int, Sequence],
        logits: torch.Tensor,
    ) -> None:
        """Logprob of each next prompt token, accumulated over the prompt's chunks.

        `prefill_rows` maps a sequence id to (its chunk's first position, its logits rows).
        Row j of a chunk starting at position p predicts the token at p + j + 1. Positions
        computed before (a prefix-cache hit) have no logits here: they get NaN.
        """
        for seq_id, (start, rows) in prefill_rows.items():
            seq = sequences[seq_id]
            done = self._values.setdefault(seq_id, [])
            top = self._top.setdefault(seq_id, [])
            done.extend([float("nan")] * (start - len(done)))
            top.extend([([], [])] * (start - len(top)))
            targets = seq.all_ids[start + 1 : min(start + 1 + len(rows), seq.prompt_len)]
            if not targets:
                continue
            logprobs = logits[rows[: len(targets)]].log_softmax(-1)  # [n, V]
            index = torch.tensor(targets, device=logits.device)[:, None]
            done.extend(logprobs.gather(1, index).squeeze(1).tolist())
            top_n = min(seq.request.top_n_tokens, logprobs.shape[-1])
            if top_n > 0:
                values, ids = logprobs.topk(top_n, dim=-1)
                top.extend(zip(ids.tolist(), values.tolist(), strict=True))

    def attach(
        self, sequences: Seq[Sequence], generations: list[pb.Generation], info: TokenizerInfo
    ) -> None:
        """Move the logprobs of sequences that just sampled their first token into their
        Generation (`generations` is in `sequences`' order)."""
        for seq, generation in zip(sequences, generations, strict=True):
            values = self._values.pop(seq.id, None)
            top = self._top.pop(seq.id, [])
            if values is None or len(seq.generated_ids) != 1:
                continue
            generation.prefill_tokens.CopyFrom(seq.prefill_tokens(values, info))
            if seq.request.top_n_tokens:
                alternatives = [([], []), *top]  # the first prompt token has none
                generation.prefill_top_tokens.extend(
                    _tokens(ids, logprobs, info) for ids, logprobs in alternatives
                )

    def drop(self, seq_id: int) -> None:
        self._values.pop(seq_id, None)
        self._top.pop(seq_id, None)

    def clear(self) -> None:
        self._values.clear()
        self._top.clear()


def _tokens(ids: list[int], logprobs: list[float], info: TokenizerInfo) -> pb.Tokens:
    return pb.Tokens(
        ids=ids,
        logprobs=logprobs,
        texts=info.texts(ids),
        is_special=[i in info.special_ids for i in ids],
    )
