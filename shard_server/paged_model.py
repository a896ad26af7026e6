"""Serve a native model over the paged KV cache, one router-planned step at a time.

The shard keeps one running set of sequences (prompt, generated tokens, stop rules,
generator). The router's scheduler decides every step: which tokens of which
sequences to compute and in which KV blocks (a `StepPlan`). Prefill, chunked prefill,
prefix-cache hits, decode and recompute after preemption are all the same thing here:
compute `token_ids` at their positions, and sample where the plan says so.

`PagedModel` serves the Step call of generate.proto; the padded protocol's Prefill /
Decode / FilterBatch are answered with `UnsupportedCall`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from textgate.kernels import AttentionMetadata, attention_backend_name
from textgate.kernels.kv_quant import KV_CACHE_DTYPES, kv_dtype_name, resolve_kv_cache_dtype
from textgate.proto import generate_pb2 as pb
from textgate.quantization.resident import resident_bytes
from textgate.shard_server.autoconfig import (
    DEFAULT_MAX_BATCH,
    DtypeChoice,
    warmup_measurements,
)
from textgate.shard_server.cuda_graphs import (
    DEFAULT_CUDA_GRAPHS,
    CudaGraphCapture,
    DecodeGraphRunner,
    GraphCapture,
    graph_safe,
)
from textgate.shard_server.grammar import GrammarCompiler, GrammarError, MaskFiller
from textgate.shard_server.kv_cache import KVCache
from textgate.shard_server.memory import (
    CudaMemoryStats,
    MemoryStats,
    agree_on_blocks,
    kv_cache_budget,
    measure_warmup,
    num_kv_blocks,
)
from textgate.shard_server.model import (
    PAGED_ONLY,
    ShardModel,
    UnsupportedCall,
    append_tokens,
    sample,
)
from textgate.shard_server.sampler import Sampler, SamplingTensors
from textgate.shard_server.sequence import Sequence, TokenizerInfo

log = logging.getLogger("textgate.shard")


@dataclass(frozen=True)
class CacheConfig:
    """How the shard sizes its KV cache at warmup."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int = 1 << 30
    """Bytes of KV cache on CPU."""
    cuda_memory_fraction: float = 0.9
    """Share of the GPU memory left free after loading that the cache may take."""
    kv_cache_dtype: str = "auto"
    """KV element dtype: auto (the model's), int8, fp8 / fp8_e4m3 (kernels/kv_quant.py)."""
    cuda_graphs: tuple[int, ...] = DEFAULT_CUDA_GRAPHS
    """Decode batch sizes captured as CUDA graphs at warmup (empty: none; ignored on CPU)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.cuda_memory_fraction <= 1:
            raise ValueError("cuda_memory_fraction must lie in (0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {self.kv_cache_dtype!r}; expected one of: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if any(size < 1 for size in self.cuda_graphs):
            raise ValueError(f"cuda_graphs sizes must be positive, got {self.cuda_graphs}")


@dataclass
class StepInputs:
    """The flat varlen batch of one step, and where each sequence's results are."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] token rows whose logits are needed
    sample_rows: list[int] = field(default_factory=list)  # rows of logits to sample from
    sampled: list[Sequence] = field(default_factory=list)  # their sequences, same order
    # seq id -> (position of its first token this step, its logits rows)
    prefill_rows: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


class PagedModel(ShardModel):
    """A native model, its KV cache and the running sequences of one shard."""

    def __init__(
        self,
        model: Any,
        info: TokenizerInfo,
        model_id: str,
        cache_config: CacheConfig,
        world_size: int = 1,
        process_group: Any = None,
        graph_capture: GraphCapture | None = None,
    ) -> None:
        self.model = model
        self.info = info
        self.model_id = model_id
        self.cache_config = cache_config
        self.world_size = world_size
        self.process_group = process_group
        self.dtype_choice = DtypeChoice(model.dtype, "flag")
        """How the weights' dtype was picked (the loader sets it; Warmup reports it)."""
        self.device = torch.device(model.device)
        # Raises when the model's attention backend cannot read the quantized cache.
        model.set_kv_cache_dtype(resolve_kv_cache_dtype(cache_config.kv_cache_dtype, model.dtype))
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(
            info.tokenizer, model.config.vocab_size, sorted(info.eos_token_ids)
        )
        self.mask_filler = MaskFiller()
        self.sequences: dict[int, Sequence] = {}
        self.kv_cache: KVCache | None = None
        self.graph_capture = graph_capture
        """How decode graphs are recorded; None: real CUDA graphs on a GPU, none on CPU."""
        self.graphs: DecodeGraphRunner | None = None
        self._prompt_logprobs: dict[int, list[float]] = {}

    def describe(self) -> pb.InfoResponse:
        config = self.model.config
        return pb.InfoResponse(
            requires_padding=False,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device_type=self.device.type,
            block_size=self.cache_config.block_size,
            max_position_embeddings=config.max_position_embeddings,
            model_id=self.model_id,
            model_type=config.model_type,
            world_size=self.world_size,
            quantize=getattr(self.model, "quantize", None) or "",
            weight_bytes=resident_bytes(self.model),
            kv_cache_dtype=kv_dtype_name(self.model.kv_cache_dtype),
            attention_backend=attention_backend_name(self.model.attention_backend),
            kv_cache_bytes_per_token=KVCache.bytes_per_block(
                num_layers=self.model.num_layers,
                block_size=1,
                num_kv_heads=self.model.num_kv_heads,
                head_dim=self.model.head_dim,
                dtype=self.model.kv_cache_dtype,
            ),
        )

    # -- warmup -----------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        """Memory one KV block takes over all layers, K and V."""
        return KVCache.bytes_per_block(
            num_layers=self.model.num_layers,
            block_size=self.cache_config.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.model.kv_cache_dtype,
        )

    def num_blocks(self) -> int:
        """How many KV blocks fit in the memory the cache may take (before any warmup
        pass: on a GPU, warmup sizes the cache from a measured pass instead)."""
        per_block = self.bytes_per_block()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.cache_config.cuda_memory_fraction)
        else:
            budget = self.cache_config.kv_cache_memory
        return max(budget // per_block, 1)

    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Size and allocate the cache, run one prefill as large as the router allows,
        capture the decode graphs, then measure the step (`autoconfig.warmup_measurements`)
        for the router's defaults.

        On a GPU the cache is sized from what a real pass at the largest prefill and batch
        left free (memory.py); on CPU it takes `kv_cache_memory`. With decode graphs one
        extra block, the last, is the padding rows' scratch block: the router never sees it.
        """
        self.clear(None)
        self.kv_cache = None
        self.graphs = None
        capture = self._graph_capture()
        reserved = 1 if capture is not None else 0
        block_size = self.cache_config.block_size
        if self.device.type == "cuda":
            num_blocks = self._profiled_num_blocks(request, reserved)
        else:
            num_blocks = self.num_blocks() - reserved
            if num_blocks < 1:
                raise ValueError("the KV cache memory holds no block beside the scratch block")
        self.kv_cache = self.model.allocate_kv_cache(num_blocks + reserved, block_size)
        tokens = max(min(request.max_prefill_tokens, num_blocks * block_size), 1)
        self._warmup_pass([tokens])
        if capture is not None:
            max_tokens = request.max_total_tokens or self.model.config.max_position_embeddings
            self.graphs = DecodeGraphRunner(
                self.model,
                self.kv_cache,
                self.cache_config.cuda_graphs,
                max_blocks_per_seq=min(-(-max_tokens // block_size), num_blocks),
                scratch_block=num_blocks,
                capture=capture,
            )
            self.graphs.capture()
        response = warmup_measurements(self, request)
        response.max_supported_total_tokens = num_blocks * block_size
        response.num_blocks = num_blocks
        return response

    def _graph_capture(self) -> GraphCapture | None:
        """How this shard records decode graphs, or None when it runs every step eager."""
        sizes = self.cache_config.cuda_graphs
        if not sizes:
            return None
        if self.graph_capture is not None:
            return self.graph_capture
        if self.device.type != "cuda":
            log.info("--cuda-graphs ignored: CUDA graphs need a GPU, this shard runs on CPU")
            return None
        backend = self.model.attention_backend
        if not graph_safe(backend):
            log.info(
                "CUDA graphs off: the %s attention backend reads step lengths on the host "
                "(graphs need a backend that reads them on the GPU)",
                type(backend).__name__,
            )
            return None
        return CudaGraphCapture(self.device)

    def _profiled_num_blocks(
        self, request: pb.WarmupRequest, reserved: int, stats: MemoryStats | None = None
    ) -> int:
        """Blocks from the GPU memory a real warmup pass left (memory.py), agreed by all ranks.

        `stats` reads the allocator (default: this CUDA device's; tests inject others).
        """
        block_size = self.cache_config.block_size
        prefill = max(request.max_prefill_tokens, 1)
        batch = max(request.max_batch_size or DEFAULT_MAX_BATCH, *self.cache_config.cuda_graphs)
        provisional = max(-(-prefill // block_size), batch) + reserved
        self.kv_cache = self.model.allocate_kv_cache(provisional, block_size)

        def free_provisional() -> None:
            self.kv_cache = None

        profile = measure_warmup(
            stats or CudaMemoryStats(self.device),
            lambda: self._warmup_pass([prefill]),
            lambda: self._warmup_pass([1] * batch),
            free_provisional,
            with_graphs=reserved > 0,
        )
        budget = kv_cache_budget(profile, self.cache_config.cuda_memory_fraction)
        num_blocks = num_kv_blocks(budget, self.bytes_per_block(), reserved)
        num_blocks = agree_on_blocks(num_blocks, self.process_group, self.device)
        log.info(
            "KV cache: %d blocks (%.2f GiB free after warmup x %.2f, step peak %.2f GiB, "
            "graph pool %.2f GiB)",
            num_blocks,
            profile.free_bytes / 2**30,
            self.cache_config.cuda_memory_fraction,
            profile.activation_bytes / 2**30,
            profile.graph_bytes / 2**30,
        )
        return num_blocks

    def _warmup_pass(self, query_lens: list[int]) -> None:
        """One step of sequences with `query_lens` new tokens each from position 0, in
        consecutive blocks of the allocated cache (values are irrelevant: shapes only)."""
        assert self.kv_cache is not None
        block_size = self.cache_config.block_size
        tables, first = [], 0
        for length in query_lens:
            count = -(-length // block_size)
            tables.append(list(range(first, first + count)))
            first += count
        metadata = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=[0] * len(query_lens),
            block_tables=tables,
            block_size=block_size,
            device=self.device,
        )
        ends = torch.tensor(query_lens).cumsum(0) - 1
        positions = torch.cat([torch.arange(length) for length in query_lens])
        with torch.inference_mode():
            self.model(
                torch.zeros(int(ends[-1]) + 1, dtype=torch.int64, device=self.device),
                positions.to(self.device),
                self.kv_cache,
                metadata,
                ends.to(self.device),
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- ClearCache, and the padded protocol's calls (unsupported) -------------------------

    def clear(self, batch_id: int | None) -> None:
        """Forget every sequence when `batch_id` is None (the KV cache stays allocated).

        A paged shard holds no batches, so a batch id names nothing to drop.
        """
        if batch_id is None:
            self.sequences.clear()
            self._prompt_logprobs.clear()

    def filter(self, batch_id: int, request_ids: Seq[int]) -> pb.CachedBatch:
        raise UnsupportedCall(PAGED_ONLY.format(call="FilterBatch"))

    def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        raise UnsupportedCall(PAGED_ONLY.format(call="Prefill"))

    def decode(self, batches: Seq[pb.CachedBatch]) -> pb.DecodeResponse:
        raise UnsupportedCall(PAGED_ONLY.format(call="Decode"))

    # -- one step -----------------------------------------------------------------------

    def step(self, new_requests: Seq[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        """Admit `new_requests`, drop finished ones, run the plan, sample where it says."""
        start = time.perf_counter_ns()
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated: Warmup must run first")
        for request_id in plan.finished_ids:
            self._drop(request_id)
        rejected = self._admit(new_requests)
        scheduled = list(plan.scheduled)
        if rejected:
            refused = {g.request_id for g in rejected}
            scheduled = [s for s in scheduled if s.request_id not in refused]
        if not scheduled:
            return pb.StepResponse(generations=rejected)
        inputs = self._inputs(scheduled)
        # Grammar masks are filled on a worker thread while the forward pass runs.
        states = [seq.grammar for seq in inputs.sampled]
        masks = self.mask_filler.start(states, self.grammars.vocab_size)
        with torch.inference_mode():
            logits = self._forward(inputs)  # [N, V]
            self._record_prompt_logprobs(inputs, logits)
            result = None
            if inputs.sampled:
                params = SamplingTensors.from_sequences(inputs.sampled, self.device)
                rows = logits  # [S, V]
                # sample_rows ascend, so as many of them as logits rows means all rows:
                # skip copying [S, V] (a decode step's common case).
                if len(inputs.sample_rows) != logits.shape[0]:
                    rows = logits[inputs.sample_rows]
                grammar = masks.result() if masks is not None else None
                result = sample(self.sampler, rows, inputs.sampled, params, self.info, grammar)
        forward_done = time.perf_counter_ns()
        generations: list[pb.Generation] = []
        if result is not None:
            generations, running = append_tokens(inputs.sampled, result, self.info)
            self._attach_prompt_logprobs(inputs.sampled, generations)
            still = set(running)
            for seq in inputs.sampled:
                if seq.id not in still:
                    self._drop(seq.id)
        return pb.StepResponse(
            generations=rejected + generations,
            forward_ns=forward_done - start,
            decode_ns=time.perf_counter_ns() - forward_done,
        )

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [N, V] of the step: through a decode graph where one fits, else eager."""
        assert self.kv_cache is not None
        if self.graphs is not None and not inputs.prefill_rows:
            logits = self.graphs.run(
                inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices
            )
            if logits is not None:
                return logits
        eager: torch.Tensor = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_cache,
            inputs.metadata,
            inputs.logits_indices,
        )
        return eager

    def _admit(self, requests: Seq[pb.Request]) -> list[pb.Generation]:
        """Add the new requests' sequences; a request whose grammar does not compile is
        not added, and answered with an error Generation instead."""
        rejected = []
        for request in requests:
            try:
                seq = Sequence.from_pb(request, self.info, self.device, self.grammars)
            except GrammarError as exc:
                rejected.append(pb.Generation(request_id=request.id, error=str(exc)))
                continue
            self.sequences[request.id] = seq
        return rejected

    def _drop(self, request_id: int) -> None:
        self.sequences.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def _inputs(self, scheduled: Seq[pb.ScheduledRequest]) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        indices: list[int] = []
        inputs_rows: list[tuple[Sequence, int, int, bool]] = []
        for item in scheduled:
            seq = self.sequences.get(item.request_id)
            if seq is None:
                raise KeyError(f"request {item.request_id} is not known to this shard")
            offset, count = len(ids), len(item.token_ids)
            ids.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + count))
            inputs_rows.append((seq, offset, count, item.produces_token))
        metadata = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in scheduled],
            context_lens=[s.start_position for s in scheduled],
            block_tables=[list(s.block_table) for s in scheduled],
            block_size=self.cache_config.block_size,
            device=self.device,
        )
        step = StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            logits_indices=torch.empty(0),
        )
        for (seq, offset, count, produces), item in zip(inputs_rows, scheduled, strict=True):
            if self._wants_prompt_logprobs(seq, item.start_position):
                rows = list(range(len(indices), len(indices) + count))
                step.prefill_rows[seq.id] = (item.start_position, rows)
                indices.extend(range(offset, offset + count))
            elif produces:
                indices.append(offset + count - 1)
            if produces:
                step.sample_rows.append(len(indices) - 1)
                step.sampled.append(seq)
        step.logits_indices = torch.tensor(indices, dtype=torch.int64, device=self.device)
        return step

    def _wants_prompt_logprobs(self, seq: Sequence, start: int) -> bool:
        return seq.request.prefill_logprobs and not seq.generated_ids and start < seq.prompt_len

    def _record_prompt_logprobs(self, inputs: StepInputs, logits: torch.Tensor) -> None:
        """Logprob of each next prompt token, accumulated over the prompt's chunks.

        Row j of a chunk starting at position p predicts the token at p + j + 1. Positions
        computed before (a prefix-cache hit) have no logits here: they get NaN.
        """
        for seq_id, (start, rows) in inputs.prefill_rows.items():
            seq = self.sequences[seq_id]
            done = self._prompt_logprobs.setdefault(seq_id, [])
            done.extend([float("nan")] * (start - len(done)))
            targets = seq.all_ids[start + 1 : min(start + 1 + len(rows), seq.prompt_len)]
            if not targets:
                continue
            logprobs = logits[rows[: len(targets)]].log_softmax(-1)  # [n, V]
            index = torch.tensor(targets, device=logits.device)[:, None]
            done.extend(logprobs.gather(1, index).squeeze(1).tolist())

    def _attach_prompt_logprobs(
        self, sequences: Seq[Sequence], generations: list[pb.Generation]
    ) -> None:
        for seq, generation in zip(sequences, generations, strict=True):
            values = self._prompt_logprobs.pop(seq.id, None)
            if values is not None and len(seq.generated_ids) == 1:
                generation.prefill_tokens.CopyFrom(seq.prefill_tokens(values, self.info))
