"""Serve a model over the paged KV cache, one router-planned step at a time.

The shard keeps one running set of sequences (prompt, generated tokens, stop rules,
generator). The router's scheduler decides every step: which tokens of which
sequences to compute and in which KV blocks (a `StepPlan`). Prefill, chunked prefill,
prefix-cache hits, decode and recompute after preemption are all the same thing here:
compute `token_ids` at their positions, and sample where the plan says so.

`PagedModel` is what the shard's servicer calls for each call of generate.proto. Its
parts live beside it:
`step_inputs` (the plan as a flat batch), `prompt_logprobs`, `paged_warmup` (graph
capture choice, shapes-only passes), `cache_config` and `kv_tiers` (the plan's copies of
prefix blocks to and from the host and disk tiers, run before the step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from textgate.kernels import attention_backend_name
from textgate.kernels.kv_quant import kv_dtype_name, resolve_kv_cache_dtype
from textgate.proto import generate_pb2 as pb
from textgate.quantization.resident import resident_bytes
from textgate.shard_server.layers.lora import LoraRows, lora_rows
from textgate.shard_server.layers.lora_slots import LoraSlots
from textgate.shard_server.startup.cache_config import CacheConfig
from textgate.shard_server.startup.dtype_choice import DtypeChoice
from textgate.shard_server.startup.hardware import cpu_kernel_report
from textgate.shard_server.startup.memory import (
    CudaMemoryStats,
    MemoryStats,
    agree_on_blocks,
    kv_cache_budget,
    measure_warmup,
    num_kv_blocks,
)
from textgate.shard_server.startup.paged_warmup import pick_graph_capture, warmup_pass
from textgate.shard_server.startup.step_timing import DEFAULT_MAX_BATCH, warmup_measurements
from textgate.shard_server.step.cuda_graphs import DecodeGraphRunner, GraphCapture
from textgate.shard_server.step.draft_proposer import DraftOutput, DraftProposer
from textgate.shard_server.step.grammar import (
    GrammarCompiler,
    GrammarError,
    MaskFiller,
    PendingMasks,
)
from textgate.shard_server.step.kv_cache import KVCache
from textgate.shard_server.step.kv_tiers import KvLayout, KvTierStore
from textgate.shard_server.step.postprocess import SampleRows, append_tokens, sample
from textgate.shard_server.step.prompt_logprobs import PromptLogprobs
from textgate.shard_server.step.sampler import Sampler, SamplerOutput, SamplingTensors
from textgate.shard_server.step.sequence import Sequence, TokenizerInfo
from textgate.shard_server.step.step_inputs import StepInputs, build_step_inputs

__all__ = ["CacheConfig", "PagedModel", "StepInputs"]

log = logging.getLogger("textgate.shard")


class PagedModel:
    """A model (native, or transformers' modules), its KV cache and the running sequences
    of one shard: what the servicer calls, one call at a time, from the model thread.
    Responses leave `total_ns` to the servicer, which times the whole call."""

    def __init__(
        self,
        model: Any,
        info: TokenizerInfo,
        model_id: str,
        cache_config: CacheConfig,
        world_size: int = 1,
        process_group: Any = None,
        graph_capture: GraphCapture | None = None,
        draft: DraftProposer | None = None,
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
        self.kv_tiers: KvTierStore | None = None
        """Host copies (and disk files) of evicted prefix blocks; made at warmup."""
        self.graph_capture = graph_capture
        """How decode graphs are recorded; None: real CUDA graphs on a GPU, none on CPU."""
        self.graphs: DecodeGraphRunner | None = None
        self.prompt_logprobs = PromptLogprobs()
        self.lora = LoraSlots(model, unsupported="LoRA adapters need a native model")
        """LoRA adapters attached to the model, id -> slot; the loader sets its limits."""
        self.draft = draft
        """Draft-model speculation's proposer (`--speculative-model`); None: no draft model."""

    def describe(self) -> pb.InfoResponse:
        """Info: the model facts the router validates and tokenizes with."""
        config = self.model.config
        return pb.InfoResponse(
            requires_padding=False,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device_type=self.device.type,
            block_size=self.cache_config.block_size,
            max_position_embeddings=config.max_position_embeddings,
            model_id=self.model_id,
            model_type=config.model_type,
            model_implementation=self.model.implementation,
            world_size=self.world_size,
            quantize=getattr(self.model, "quantize", None) or "",
            weight_bytes=resident_bytes(self.model),
            kv_cache_dtype=kv_dtype_name(self.model.kv_cache_dtype),
            attention_backend=attention_backend_name(self.model.attention_backend),
            kv_cache_bytes_per_token=self._kv_bytes(block_size=1),
            cpu_kernels=cpu_kernel_report() if self.device.type == "cpu" else {},
            lora_adapters=sorted(self.lora.loaded),
            max_loras=0 if self.lora.unsupported else self.lora.limits.max_loras,
            max_lora_rank=0 if self.lora.unsupported else self.lora.limits.max_rank,
            resident_lora_adapters=sorted(self.lora.slots),
            max_cpu_loras=0 if self.lora.unsupported else self.lora.limits.max_loaded,
        )

    # -- warmup -----------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        """Memory one KV block takes over all layers, K and V (the draft model's block too:
        its cache has the same blocks)."""
        draft = self.draft.bytes_per_block() if self.draft is not None else 0
        return self._kv_bytes(self.cache_config.block_size) + draft

    def _kv_bytes(self, block_size: int) -> int:
        return KVCache.bytes_per_block(
            num_layers=self.model.num_layers,
            block_size=block_size,
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
        if self.draft is not None:
            budget -= self.draft.reserved_bytes()
        return max(budget // per_block, 1)

    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Size and allocate the cache, run one prefill as large as the router allows,
        capture the decode graphs, then measure the step (`step_timing.warmup_measurements`)
        for the router's defaults.

        On a GPU the cache is sized from what a real pass at the largest prefill and batch
        left free (memory.py); on CPU it takes `kv_cache_memory`. With decode graphs one
        extra block, the last, is the padding rows' scratch block: the router never sees it.
        """
        self.clear()
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
        if self.draft is not None:
            self.draft.allocate(num_blocks, tokens)
            assert self.draft.kv_cache is not None
            warmup_pass(self.draft.model, self.draft.kv_cache, [tokens], block_size, self.device)
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
        self.kv_tiers = KvTierStore(self.device, self._kv_disk_dir())
        response.kv_offload_disk_hashes.extend(self.kv_tiers.disk_hashes())
        return response

    def _kv_disk_dir(self) -> Path | None:
        """This rank's disk-tier folder: one per model, KV dtype and layout (None: off)."""
        root = self.cache_config.kv_offload_dir
        if root is None:
            return None
        rank = dist.get_rank(self.process_group) if self.world_size > 1 else 0
        layout = KvLayout(
            model_id=self.model_id,
            quantize=getattr(self.model, "quantize", None) or "",
            kv_dtype=kv_dtype_name(self.model.kv_cache_dtype),
            block_size=self.cache_config.block_size,
            num_layers=self.model.num_layers,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            rank=rank,
            world_size=self.world_size,
        )
        return KvTierStore.folder(Path(root), layout)

    def _graph_capture(self) -> GraphCapture | None:
        """How this shard records decode graphs, or None when it runs every step eager."""
        return pick_graph_capture(
            self.cache_config.cuda_graphs,
            self.graph_capture,
            self.device,
            self.model.attention_backend,
        )

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
        if self.draft is not None:
            budget -= self.draft.reserved_bytes()
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
        assert self.kv_cache is not None
        warmup_pass(
            self.model, self.kv_cache, query_lens, self.cache_config.block_size, self.device
        )

    # -- ClearCache ----------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every sequence (the KV cache stays allocated)."""
        self.sequences.clear()
        self.prompt_logprobs.clear()
        if self.draft is not None:
            self.draft.clear()
        if self.kv_tiers is not None:
            self.kv_tiers.clear()

    # -- one step -----------------------------------------------------------------------

    def step(self, new_requests: Seq[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        """Admit `new_requests`, drop finished ones, run the plan, sample where it says."""
        start = time.perf_counter_ns()
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated: Warmup must run first")
        if plan.kv_transfers:  # before this step writes or reads any KV
            if self.kv_tiers is None:
                raise RuntimeError("the plan carries KV-tier transfers before Warmup ran")
            self.kv_tiers.apply(plan.kv_transfers, self.kv_cache)
        for request_id in plan.finished_ids:
            self._drop(request_id)
        if plan.HasField("lora_residency"):  # the router's choice, before any row runs
            self.lora.reside(plan.lora_residency.adapter_ids)
        rejected = self._admit(new_requests)
        scheduled = list(plan.scheduled)
        if rejected:
            refused = {g.request_id for g in rejected}
            scheduled = [s for s in scheduled if s.request_id not in refused]
        if not scheduled:
            return pb.StepResponse(generations=rejected)
        inputs = self._inputs(scheduled)
        rows = SampleRows.expand(inputs.sampled, inputs.drafts)
        # Grammar masks are filled on a worker thread while the forward pass runs.
        states = [seq.grammar for seq in rows.sequences]
        masks = self.mask_filler.start(states, self.grammars.vocab_size, rows.conditioned)
        with torch.inference_mode():
            logits = self._forward(inputs)  # [N, V]
            self.prompt_logprobs.record(inputs.prefill_rows, self.sequences, logits)
            result = self._sample(inputs, rows, logits, masks) if inputs.sampled else None
        forward_done = time.perf_counter_ns()
        generations = self._append(inputs, result, masks) if result is not None else []
        decoded = time.perf_counter_ns()
        drafted = self._propose(self.draft, scheduled, generations) if self.draft else DraftOutput()
        return pb.StepResponse(
            generations=rejected + generations,
            forward_ns=forward_done - start,
            decode_ns=decoded - forward_done,
            draft_ns=time.perf_counter_ns() - decoded,
            draft_pass_ns=drafted.pass_ns,
            draft_pass_rows=drafted.pass_rows,
        )

    def _propose(
        self,
        draft: DraftProposer,
        scheduled: Seq[pb.ScheduledRequest],
        generations: list[pb.Generation],
    ) -> DraftOutput:
        """The draft model's guesses for the sequences the plan asked them for (the
        still running ones), on their Generations: the drafts of their next step. Guesses
        are optional: a draft that fails is logged, forgets its cache and guesses nothing
        this step, and the step's tokens are answered as without it."""
        answered = {g.request_id: g for g in generations}
        wanted = [
            (self.sequences[item.request_id], item.block_table, item.num_proposed_tokens)
            for item in scheduled
            if item.num_proposed_tokens
            and item.request_id in answered
            and item.request_id in self.sequences
        ]
        if not wanted:
            return DraftOutput()
        try:
            with torch.inference_mode():
                drafted = draft.propose(wanted)
        except Exception:
            log.exception("the draft model failed: no guesses this step")
            draft.clear()
            return DraftOutput()
        for request_id, tokens in drafted.guesses.items():
            answered[request_id].proposed_token_ids.extend(tokens)
        return drafted

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [N, V] of the step: through a decode graph where one fits (and no row
        uses a LoRA adapter), else eager."""
        assert self.kv_cache is not None
        rows = self._lora_rows(inputs)
        if rows is not None:
            with lora_rows(rows):
                return self._eager(inputs)
        if self.graphs is not None and not inputs.prefill_rows:
            logits = self.graphs.run(
                inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices
            )
            if logits is not None:
                return logits
        return self._eager(inputs)

    def _lora_rows(self, inputs: StepInputs) -> LoraRows | None:
        """Which of the step's rows run which adapter (None: all run the base)."""
        if not self.lora.loaded:
            return None
        slot_of = self.lora.slot_of
        slots = [slot_of(seq.request.adapter_id) for seq in inputs.row_sequences]
        return LoraRows.from_slots(slots, self.device)

    def _eager(self, inputs: StepInputs) -> torch.Tensor:
        assert self.kv_cache is not None
        eager: torch.Tensor = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_cache,
            inputs.metadata,
            inputs.logits_indices,
        )
        return eager

    def _sample(
        self,
        inputs: StepInputs,
        rows: SampleRows,
        logits: torch.Tensor,
        masks: PendingMasks | None,
    ) -> SamplerOutput:
        """Next tokens of the sequences that sample this step (and one per draft they
        verify), from their logits rows."""
        params = SamplingTensors.from_sequences(rows.sequences, self.device, rows.offsets)
        sampled = logits  # [R, V]
        # sample_rows ascend, so as many of them as logits rows means all rows:
        # skip copying [R, V] (a decode step's common case).
        if len(inputs.sample_rows) != logits.shape[0]:
            sampled = logits[inputs.sample_rows]
        grammar = masks.result() if masks is not None else None
        return sample(
            self.sampler, sampled, rows.sequences, params, self.info, grammar, rows.conditioned
        )

    def _append(
        self, inputs: StepInputs, result: SamplerOutput, masks: PendingMasks | None
    ) -> list[pb.Generation]:
        """Feed the sampled tokens (accepted drafts, then each sequence's own) to their
        sequences; drop the ones that finished."""
        sampled = inputs.sampled
        grammar = masks.result() if masks is not None else None
        generations, running = append_tokens(sampled, result, self.info, inputs.drafts, grammar)
        self.prompt_logprobs.attach(sampled, generations, self.info)
        still = set(running)
        for seq in sampled:
            if seq.id not in still:
                self._drop(seq.id)
        return generations

    def _admit(self, requests: Seq[pb.Request]) -> list[pb.Generation]:
        """Add the new requests' sequences; a request whose grammar does not compile is
        not added, and answered with an error Generation instead."""
        rejected = []
        for request in requests:
            if request.adapter_id and request.adapter_id not in self.lora.loaded:
                known = ", ".join(sorted(self.lora.loaded)) or "none"
                message = f"LoRA adapter {request.adapter_id!r} is not loaded (loaded: {known})"
                rejected.append(pb.Generation(request_id=request.id, error=message))
                continue
            try:
                seq = Sequence.from_pb(request, self.info, self.device, self.grammars)
            except GrammarError as exc:
                rejected.append(pb.Generation(request_id=request.id, error=str(exc)))
                continue
            self.sequences[request.id] = seq
        return rejected

    def _drop(self, request_id: int) -> None:
        self.sequences.pop(request_id, None)
        self.prompt_logprobs.drop(request_id)
        if self.draft is not None:
            self.draft.drop(request_id)

    def _inputs(self, scheduled: Seq[pb.ScheduledRequest]) -> StepInputs:
        assert self.kv_cache is not None
        return build_step_inputs(
            scheduled,
            self.sequences,
            self.cache_config.block_size,
            self.device,
            num_blocks=self.kv_cache.num_blocks,
        )
