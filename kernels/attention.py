"""Paged attention: the backend interface and its step metadata (the SDPA reference
backend is kernels/sdpa.py, re-exported here).

A step is a flat varlen batch (vLLM-style): the new tokens of every sequence are
concatenated into T rows. Sequence b owns rows query_start_loc[b]:query_start_loc[b+1]
and attends, causally, to its first seq_lens[b] cache slots: its cached prefix, then
this step's tokens (which the model stores in the cache before calling the backend).
Pure prefill, prefill over a cached prefix (prefix caching, chunked prefill), pure
decode and any mix of them are the same computation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries and keys are, for one forward step (B sequences, T tokens).

    Integer tensors live on the model's device. `block_tables` rows may be padded with
    any value (e.g. -1 or 0) past a sequence's last block.
    """

    #: [B+1] cumulative query counts, starting at 0 (cu_seqlens_q).
    query_start_loc: Tensor
    #: [B] total kv length per sequence: cached prefix plus this step's tokens.
    seq_lens: Tensor
    #: [B, max_blocks] the cache blocks of each sequence, in order.
    block_tables: Tensor
    #: [T] cache slot of each new token: block_id * block_size + offset in block.
    slot_mapping: Tensor
    #: Longest query run of any sequence in this step (1 for a pure decode step).
    max_seqlen_q: int
    #: Longest seq_lens entry.
    max_seqlen_k: int

    @property
    def cu_seqlens_q(self) -> Tensor:
        """flash-attention's name for `query_start_loc`."""
        return self.query_start_loc

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def query_lens(self) -> Tensor:
        """[B] new tokens per sequence."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def context_lens(self) -> Tensor:
        """[B] cached tokens per sequence before this step."""
        return self.seq_lens - self.query_lens()

    def token_seq_index(self) -> Tensor:
        """[T] the sequence each token belongs to."""
        tokens = torch.arange(self.num_tokens, device=self.query_start_loc.device)
        return torch.searchsorted(self.query_start_loc[1:], tokens, right=True)

    def positions(self) -> Tensor:
        """[T] the absolute position of each new token in its sequence."""
        seq = self.token_seq_index()
        tokens = torch.arange(self.num_tokens, device=seq.device)
        return self.context_lens()[seq] + tokens - self.query_start_loc[seq]

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences with `query_lens` new tokens after `context_lens` cached ones.

        block_tables[b] lists sequence b's blocks and must cover all its tokens.
        """
        if not len(query_lens) == len(context_lens) == len(block_tables):
            raise ValueError("query_lens, context_lens and block_tables differ in length")
        seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        for b, (length, blocks) in enumerate(zip(seq_lens, block_tables, strict=True)):
            if len(blocks) * block_size < length:
                raise ValueError(f"sequence {b}: {len(blocks)} blocks cannot hold {length} tokens")
            if query_lens[b] < 1:
                raise ValueError(f"sequence {b} has no new tokens")
        max_blocks = max(len(blocks) for blocks in block_tables)
        table = torch.tensor(
            [[*blocks, *[0] * (max_blocks - len(blocks))] for blocks in block_tables]
        )
        q_lens = torch.tensor(query_lens)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])  # [B+1]
        seq = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # [T]
        positions = torch.tensor(context_lens)[seq] + torch.arange(len(seq)) - starts[seq]
        slots = table[seq, positions // block_size] * block_size + positions % block_size
        return cls(
            query_start_loc=starts.to(device),
            seq_lens=torch.tensor(seq_lens, device=device),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
        )


PlanT = TypeVar("PlanT")


class AttentionBackend(ABC, Generic[PlanT]):
    """Attention of a step's queries over the paged KV cache.

    `prepare` turns the step's metadata into whatever the backend precomputes once
    (masks, index tensors); `forward` runs one layer with it.
    """

    #: Whether `forward` reads int8 / fp8 caches with their scales (kernels/kv_quant.py).
    supports_quantized_kv: ClassVar[bool] = False
    #: Whether `forward` also takes `softcap` and `sinks` (kernels/sdpa.py says what they do).
    supports_softcap_and_sinks: ClassVar[bool] = False

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> PlanT:
        """Precompute per-step state shared by all layers."""

    @abstractmethod
    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        plan: PlanT,
        *,
        scale: float,
        sliding_window: int | None = None,
        key_scales: Tensor | None = None,
        value_scales: Tensor | None = None,
    ) -> Tensor:
        """query [T, H_q, D] over a layer's caches [num_blocks, block_size, H_kv, D] → [T, H_q, D].

        The step's keys/values must already be stored. H_q must be a multiple of H_kv
        (grouped-query attention: query head h reads kv head h // (H_q / H_kv)).
        `sliding_window` w lets a query at position p see keys at positions > p - w.
        A quantized cache comes with its scales [num_blocks, block_size, H_kv]
        (kernels/kv_quant.py); they are None for a cache in a float dtype.
        """


# Re-exported for `from textgate.kernels.attention import SdpaAttentionBackend`. Last, because
# kernels/sdpa.py imports the names above: the package __init__ imports this module first.
from textgate.kernels.sdpa import SdpaAttentionBackend, SdpaPlan, SeqGroup  # noqa: E402

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "SdpaAttentionBackend",
    "SdpaPlan",
    "SeqGroup",
]
