"""`StepInputs`: the flat varlen batch a `StepPlan` describes, built for one forward pass."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from textgate.kernels import AttentionMetadata
from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.prompt_logprobs import wants_prompt_logprobs
from textgate.shard_server.step.sequence import Sequence


@dataclass
class StepInputs:
    """The flat varlen batch of one step, and where each sequence's results are."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] token rows whose logits are needed
    sample_rows: list[int] = field(default_factory=list)  # rows of logits to sample from
    sampled: list[Sequence] = field(default_factory=list)  # the sequences that sample
    # [S] per sampled sequence, the drafts it verifies (speculation; () for most): it has
    # len + 1 consecutive sample rows, row i conditioned on the first i drafts
    drafts: list[tuple[int, ...]] = field(default_factory=list)
    # seq id -> (position of its first token this step, its logits rows)
    prefill_rows: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    row_sequences: list[Sequence] = field(default_factory=list)  # [T] each token row's


def build_step_inputs(
    scheduled: Seq[pb.ScheduledRequest],
    sequences: Mapping[int, Sequence],
    block_size: int,
    device: torch.device,
    num_blocks: int,
) -> StepInputs:
    """The step's tokens, positions and attention metadata, and which logits rows it needs:
    the last row of a sequence that samples, every row of a chunk that wants prompt
    logprobs (`prompt_logprobs.wants_prompt_logprobs`). A block table naming a block past
    the cache's `num_blocks` is a ValueError here, before a kernel writes through it."""
    ids: list[int] = []
    positions: list[int] = []
    indices: list[int] = []  # token rows whose logits are needed
    sample_rows: list[int] = []
    sampled: list[Sequence] = []
    drafts: list[tuple[int, ...]] = []
    prefill_rows: dict[int, tuple[int, list[int]]] = {}
    row_sequences: list[Sequence] = []
    for item in scheduled:
        seq = sequences.get(item.request_id)
        if seq is None:
            raise KeyError(f"request {item.request_id} is not known to this shard")
        last_block = max(item.block_table, default=-1)
        if last_block >= num_blocks:
            raise ValueError(
                f"request {item.request_id}: block {last_block} is outside the KV cache of "
                f"{num_blocks} blocks"
            )
        start, offset, count = item.start_position, len(ids), len(item.token_ids)
        ids.extend(item.token_ids)
        row_sequences.extend([seq] * count)
        positions.extend(range(start, start + count))
        num_drafts = _checked_drafts(item, seq)
        if wants_prompt_logprobs(seq, start):
            prefill_rows[seq.id] = (start, list(range(len(indices), len(indices) + count)))
            indices.extend(range(offset, offset + count))
        elif item.produces_token:
            indices.extend(range(offset + count - 1 - num_drafts, offset + count))
        if item.produces_token:
            sample_rows.extend(range(len(indices) - 1 - num_drafts, len(indices)))
            sampled.append(seq)
            drafts.append(tuple(item.token_ids[count - num_drafts :]) if num_drafts else ())
    metadata = AttentionMetadata.build(
        query_lens=[len(s.token_ids) for s in scheduled],
        context_lens=[s.start_position for s in scheduled],
        block_tables=[list(s.block_table) for s in scheduled],
        block_size=block_size,
        device=device,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        logits_indices=torch.tensor(indices, dtype=torch.int64, device=device),
        sample_rows=sample_rows,
        sampled=sampled,
        drafts=drafts,
        prefill_rows=prefill_rows,
        row_sequences=row_sequences,
    )


def _checked_drafts(item: pb.ScheduledRequest, seq: Sequence) -> int:
    """The request's drafts (speculation), or ValueError for a plan that cannot verify them."""
    num_drafts = item.num_draft_tokens
    if not num_drafts:
        return 0
    if not item.produces_token or num_drafts >= len(item.token_ids):
        raise ValueError(
            f"request {item.request_id}: {num_drafts} drafts need a step that samples and "
            "computes at least one known token before them"
        )
    if item.start_position < seq.prompt_len:
        raise ValueError(f"request {item.request_id}: drafts only follow a decoded token")
    return num_drafts
