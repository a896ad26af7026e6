"""The reference attention backend: PyTorch SDPA over the paged KV cache.

Sequences are gathered through their block tables into padded batches (decodes and
prefills apart) and attended by one masked `scaled_dot_product_attention` call each.
The interface and the step metadata it reads are kernels/attention.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from textgate.kernels import kv_quant
from textgate.kernels.attention import AttentionBackend, AttentionMetadata


@dataclass
class SeqGroup:
    """Sequences attended by one batched SDPA call, padded to max_q queries × max_k keys."""

    #: [Tg] rows of the flat batch that belong to this group; None: all rows, in order.
    token_index: Tensor | None
    #: [Tg] each row's place in the padded [num_seqs * max_q] layout; None: no padding.
    pad_index: Tensor | None
    #: [num_seqs, max_blocks] block ids (padding clamped to a valid id).
    block_tables: Tensor
    #: [num_seqs, max_q] absolute position of each padded query, clamped into its sequence.
    query_pos: Tensor
    num_seqs: int
    max_q: int
    max_k: int
    #: Some sequence is shorter than max_k (its padded keys need masking).
    ragged: bool = True
    _masks: dict[tuple[int, int | None, torch.dtype], Tensor | None] = field(default_factory=dict)
    _gather_index: dict[int, Tensor] = field(default_factory=dict)

    @property
    def plain_causal(self) -> bool:
        """Every sequence is a whole prompt of the same length (no prefix, no padding)."""
        return self.pad_index is None and self.max_q == self.max_k > 1

    def mask(self, group_size: int, window: int | None, dtype: torch.dtype) -> Tensor | None:
        """Additive mask [num_seqs, 1, rows, max_k] in `dtype`; rows = group_size * max_q (1 if decode).

        Built once per step: SDPA would otherwise turn a boolean mask into this in every
        layer. None for decodes that need no mask (every sequence max_k long, no window).
        """
        key = (group_size, window, dtype)
        if key not in self._masks:
            if self.max_q == 1 and not self.ragged and window is None:
                self._masks[key] = None
            else:
                keep = self._build_mask(group_size, window)
                self._masks[key] = torch.zeros(
                    keep.shape, dtype=dtype, device=keep.device
                ).masked_fill_(~keep, float("-inf"))
        return self._masks[key]

    def gather_index(self, block_size: int) -> Tensor:
        """[num_seqs * nblk] the blocks holding each sequence's first max_k keys, row-major."""
        if block_size not in self._gather_index:
            blocks = self.block_tables[:, : math.ceil(self.max_k / block_size)]  # [B, nblk]
            self._gather_index[block_size] = blocks.reshape(-1)
        return self._gather_index[block_size]

    def _build_mask(self, group_size: int, window: int | None) -> Tensor:
        keys = torch.arange(self.max_k, device=self.query_pos.device)  # [Lk]
        query_pos = self.query_pos[:, :, None]  # [B, Sq, 1]
        keep = keys <= query_pos  # [B, Sq, Lk]; keys past the sequence are past the query too
        if window is not None:
            keep &= keys > query_pos - window
        if self.max_q > 1 and group_size > 1:
            # Query rows are ordered (group member, position): repeat the mask per member.
            keep = keep[:, None].expand(self.num_seqs, group_size, self.max_q, self.max_k)
            keep = keep.reshape(self.num_seqs, group_size * self.max_q, self.max_k)
        return keep[:, None]  # [B, 1, rows, Lk]


@dataclass
class SdpaPlan:
    """The SDPA backend's per-step state: decode and prefill sequences in separate calls."""

    groups: list[SeqGroup]


class SdpaAttentionBackend(AttentionBackend[SdpaPlan]):
    """Reference paged attention in plain PyTorch (`scaled_dot_product_attention`).

    Each call gathers its sequences' keys through their block tables into a padded
    [B, H_kv, max_k, D] batch and runs one masked SDPA. Decoding sequences (one query)
    and prefilling ones go in separate calls so a long prompt does not pad every
    decode to its length. GQA folds each kv head's query group into the query-length
    dimension, so keys and values are never repeated per query head. Whole prompts of
    one length (the common single-prompt prefill) use SDPA's own causal mask instead.
    The plan reads a few counts on the host, which is free on CPU. A quantized cache is
    dequantized as it is gathered (only the blocks the step reads).
    """

    supports_quantized_kv = True
    supports_softcap_and_sinks = True

    def prepare(self, metadata: AttentionMetadata) -> SdpaPlan:
        if metadata.max_seqlen_q == 1:
            return SdpaPlan([self.group(metadata, None, 1, metadata.max_seqlen_k)])
        is_decode = metadata.query_lens() == 1
        num_decodes = int(is_decode.sum())
        if num_decodes == 0:
            return SdpaPlan(
                [self.group(metadata, None, metadata.max_seqlen_q, metadata.max_seqlen_k)]
            )
        groups = []
        for member, max_q in ((is_decode, 1), (~is_decode, metadata.max_seqlen_q)):
            max_k = int(metadata.seq_lens[member].max())
            groups.append(self.group(metadata, member, max_q, max_k))
        return SdpaPlan(groups)

    @staticmethod
    def group(md: AttentionMetadata, member: Tensor | None, max_q: int, max_k: int) -> SeqGroup:
        """The group of sequences selected by boolean `member` [B] (None: all of them)."""
        device = md.seq_lens.device
        seq_lens = md.seq_lens
        block_tables = md.block_tables.clamp(min=0)
        token_seq = md.token_seq_index()  # [T]
        token_index = None
        local_seq = token_seq  # [Tg] index of each token's sequence within the group
        if member is not None:
            seq_lens, block_tables = seq_lens[member], block_tables[member]
            token_index = torch.nonzero(member[token_seq]).squeeze(1)
            local_seq = (member.long().cumsum(0) - 1)[token_seq[token_index]]
        num_seqs, num_tokens = seq_lens.shape[0], local_seq.shape[0]
        pad_index = None
        if num_tokens != num_seqs * max_q:
            rows = torch.arange(md.num_tokens, device=device)
            rows = rows if token_index is None else token_index
            offsets = rows - md.query_start_loc[token_seq[rows]]
            pad_index = local_seq * max_q + offsets
        context = seq_lens - (md.query_lens() if member is None else md.query_lens()[member])
        offsets_q = torch.arange(max_q, device=device)
        query_pos = torch.minimum(context[:, None] + offsets_q, seq_lens[:, None] - 1)
        ragged = max_q > 1 or bool((seq_lens != max_k).any())
        return SeqGroup(
            token_index, pad_index, block_tables, query_pos, num_seqs, max_q, max_k, ragged
        )

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        plan: SdpaPlan,
        *,
        scale: float,
        sliding_window: int | None = None,
        key_scales: Tensor | None = None,
        value_scales: Tensor | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """The base class's forward, and what only this backend does: `softcap` c turns
        each score s into c * tanh(s / c) before masking (Gemma 2), and `sinks` [H_q] adds
        one logit per query head to every softmax, attending to nothing (gpt-oss)."""
        scales = (key_scales, value_scales)
        extras = Extras(softcap, sinks) if softcap is not None or sinks is not None else None
        if len(plan.groups) == 1 and plan.groups[0].token_index is None:
            group = plan.groups[0]
            return self.attend(
                query, key_cache, value_cache, group, scale, sliding_window, scales, extras
            )
        out = torch.empty_like(query)
        self.attend_groups(
            query, key_cache, value_cache, plan.groups, out, scale, sliding_window, scales, extras
        )
        return out

    def attend_groups(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        groups: Sequence[SeqGroup],
        out: Tensor,
        scale: float,
        window: int | None,
        scales: tuple[Tensor | None, Tensor | None] = (None, None),
        extras: Extras | None = None,
    ) -> None:
        """Write the attention of each group's rows of query [T, H_q, D] into out [T, H_q, D]
        (every group selects its rows: token_index is set). `scales`: (key, value) scales
        of a quantized cache."""
        for group in groups:
            assert group.token_index is not None
            rows = self.attend(
                query.index_select(0, group.token_index),
                key_cache,
                value_cache,
                group,
                scale,
                window,
                scales,
                extras,
            )
            out.index_copy_(0, group.token_index, rows)

    @staticmethod
    def attend(
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        group: SeqGroup,
        scale: float,
        window: int | None,
        scales: tuple[Tensor | None, Tensor | None] = (None, None),
        extras: Extras | None = None,
    ) -> Tensor:
        """query [Tg, H_q, D] of one group → attention output [Tg, H_q, D]."""
        num_seqs, max_q, max_k = group.num_seqs, group.max_q, group.max_k
        _, block_size, kv_heads, dim = key_cache.shape
        heads = query.shape[1]
        group_size = heads // kv_heads
        blocks = group.gather_index(block_size)  # [B * nblk]
        # [B, H_kv, Lk, D] each
        keys = _gather(key_cache, scales[0], blocks, num_seqs, max_k, query.dtype)
        values = _gather(value_cache, scales[1], blocks, num_seqs, max_k, query.dtype)
        if max_q == 1:
            # Decode: each kv head's query group is its query rows, no reordering needed.
            folded = query.view(num_seqs, kv_heads, group_size, dim)  # [B, H_kv, G, D]
            mask = group.mask(group_size, window, query.dtype)
            if extras is not None:
                out = extras.attend(folded, keys, values, mask, scale, 1)
            else:
                out = F.scaled_dot_product_attention(
                    folded, keys, values, attn_mask=mask, scale=scale
                )
            return out.view(num_seqs, heads, dim)  # [B, H_q, D]
        if group.plain_causal and window is None and extras is None:
            # SDPA's own causal mask lets its kernel skip the masked half of the scores.
            query = query.view(num_seqs, max_q, heads, dim).transpose(1, 2)  # [B, H_q, S, D]
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )  # [B, H_q, S, D]
            return out.transpose(1, 2).reshape(num_seqs * max_q, heads, dim)
        if group.pad_index is not None:
            padded = query.new_zeros(num_seqs * max_q, heads, dim)
            query = padded.index_copy_(0, group.pad_index, query)  # [B * Sq, H_q, D]
        folded = (
            query.view(num_seqs, max_q, kv_heads, group_size, dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(num_seqs, kv_heads, group_size * max_q, dim)
        )  # [B, H_kv, G * Sq, D]
        mask = group.mask(group_size, window, query.dtype)
        if extras is not None:
            out = extras.attend(folded, keys, values, mask, scale, max_q)
        else:
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
        out = (
            out.view(num_seqs, kv_heads, group_size, max_q, dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(num_seqs * max_q, heads, dim)
        )  # [B * Sq, H_q, D]
        return out if group.pad_index is None else out.index_select(0, group.pad_index)


@dataclass(frozen=True)
class Extras:
    """What SDPA cannot do, so attention runs eagerly: logit soft-capping, sink logits."""

    softcap: float | None
    sinks: Tensor | None  # [H_q]

    def attend(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        mask: Tensor | None,
        scale: float,
        max_q: int,
    ) -> Tensor:
        """SDPA's contract on the folded layout: query [B, H_kv, G * max_q, D] (rows in
        (group member, position) order), keys/values [B, H_kv, Lk, D], an additive mask
        broadcast over heads → [B, H_kv, G * max_q, D]. Scores and softmax in float32."""
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores + mask
        if self.sinks is None:
            probs = scores.softmax(-1)
        else:
            # Query head kv * G + g owns rows g * max_q ... (g + 1) * max_q - 1 of kv head kv.
            sink = self.sinks.float().view(keys.shape[1], -1).repeat_interleave(max_q, dim=1)
            sink = sink[None, :, :, None].expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)


def _gather(
    cache: Tensor,
    scales: Tensor | None,
    blocks: Tensor,
    num_seqs: int,
    length: int,
    dtype: torch.dtype,
) -> Tensor:
    """Keys of each sequence, cache [N, bs, H, D] and blocks [B * nblk] → [B, H, length, D]
    (a quantized cache, with its scales [N, bs, H], dequantized to `dtype`)."""
    heads, dim = cache.shape[2], cache.shape[3]
    # index_select copies whole blocks; advanced indexing (cache[blocks]) is ~10× slower on CPU.
    if scales is None:
        gathered = cache.index_select(0, blocks)  # [B * nblk, bs, H, D]
    else:
        gathered = kv_quant.gather_dequantized(cache, scales, blocks, dtype)
    gathered = gathered.view(num_seqs, -1, heads, dim)  # [B, nblk * bs, H, D]
    return gathered[:, :length].transpose(1, 2)
