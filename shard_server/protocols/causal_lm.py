"""The transformers fallback: any causal LM, batched with left padding and a DynamicCache.

Continuous batching in its simplest correct form: a `CausalLMBatch` lives in the shard
between steps; requests join by `concatenate` (caches left-padded to one length) and
leave by `filter` (rows dropped, all-padding columns trimmed). Native paged models
replace this for the architectures they cover.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.step.sampler import SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo


@dataclass
class CausalLMBatch:
    """Requests stepping together. Rows of every tensor follow `sequences`."""

    batch_id: int
    sequences: list[Sequence]
    input_ids: torch.Tensor  # [B, S]: the padded prompts before prefill, then [B, 1]
    attention_mask: torch.Tensor  # [B, L + S]: cache length L plus the next input
    position_ids: torch.Tensor  # [B, S]
    cache: DynamicCache
    sampling: SamplingTensors

    @property
    def size(self) -> int:
        return len(self.sequences)

    def to_pb(self) -> pb.CachedBatch:
        return pb.CachedBatch(
            id=self.batch_id,
            request_ids=[s.id for s in self.sequences],
            size=self.size,
            max_tokens=sum(s.max_tokens for s in self.sequences),
        )

    @classmethod
    def from_pb(cls, batch: pb.Batch, info: TokenizerInfo, device: torch.device) -> CausalLMBatch:
        sequences = [Sequence.from_pb(r, info, device) for r in batch.requests]
        longest = max(s.prompt_len for s in sequences)
        input_ids = torch.zeros(len(sequences), longest, dtype=torch.int64)
        attention_mask = torch.zeros(len(sequences), longest, dtype=torch.int64)
        for row, seq in enumerate(sequences):
            # Left padding: every row's last prompt token sits in the last column.
            input_ids[row, longest - seq.prompt_len :] = torch.tensor(seq.all_ids)
            attention_mask[row, longest - seq.prompt_len :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return cls(
            batch_id=batch.id,
            sequences=sequences,
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            cache=DynamicCache(),
            sampling=SamplingTensors.from_sequences(sequences, device),
        )

    def advance(self, next_ids: list[int]) -> None:
        """Prepare the decode input after a step: one new token per row."""
        device = self.input_ids.device
        self.input_ids = torch.tensor(next_ids, dtype=torch.int64, device=device)[:, None]
        self.position_ids = self.position_ids[:, -1:] + 1
        ones = torch.ones(self.size, 1, dtype=self.attention_mask.dtype, device=device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)

    def filter(self, request_ids: Seq[int]) -> CausalLMBatch | None:
        """Keep only `request_ids` (in batch order); None when nothing is left."""
        keep = set(request_ids)
        rows = [row for row, s in enumerate(self.sequences) if s.id in keep]
        if not rows:
            return None
        if len(rows) == self.size:
            return self
        index = torch.tensor(rows, dtype=torch.int64, device=self.input_ids.device)
        mask = self.attention_mask[index]
        # Columns that are padding for every kept row are dropped from mask and cache.
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[index, :, start:]
                layer.values = layer.values[index, :, start:]
        self.sequences = [self.sequences[r] for r in rows]
        self.input_ids = self.input_ids[index]
        self.attention_mask = mask[:, start:]
        self.position_ids = self.position_ids[index]
        self.sampling = self.sampling.select(rows)
        return self

    @classmethod
    def concatenate(cls, batches: Seq[CausalLMBatch]) -> CausalLMBatch:
        """Merge decode-ready batches; shorter caches are left-padded. Keeps the first id."""
        if len(batches) == 1:
            return batches[0]
        length = max(b.attention_mask.shape[1] for b in batches)
        masks = [F.pad(b.attention_mask, (length - b.attention_mask.shape[1], 0)) for b in batches]
        layers = []
        for index in range(len(batches[0].cache.layers)):
            keys, values = [], []
            for b in batches:
                layer = b.cache.layers[index]
                pad = length - 1 - layer.keys.shape[2]  # the cache lacks the next input column
                keys.append(F.pad(layer.keys, (0, 0, pad, 0)))
                values.append(F.pad(layer.values, (0, 0, pad, 0)))
            layers.append((torch.cat(keys), torch.cat(values)))
        return cls(
            batch_id=batches[0].batch_id,
            sequences=[s for b in batches for s in b.sequences],
            input_ids=torch.cat([b.input_ids for b in batches]),
            attention_mask=torch.cat(masks),
            position_ids=torch.cat([b.position_ids for b in batches]),
            cache=DynamicCache(ddp_cache_data=layers),
            sampling=SamplingTensors.concatenate([b.sampling for b in batches]),
        )
