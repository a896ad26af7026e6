"""Serve any transformers causal LM (the fallback for architectures without a native model)."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from textgate.proto import generate_pb2 as pb
from textgate.quantization.resident import resident_bytes
from textgate.shard_server.protocols.causal_lm import CausalLMBatch
from textgate.shard_server.protocols.padded_model import PaddedModel, StepOutput
from textgate.shard_server.startup.hardware import cpu_kernel_report
from textgate.shard_server.step.postprocess import append_tokens, sample
from textgate.shard_server.step.sampler import Sampler
from textgate.shard_server.step.sequence import TokenizerInfo


class TransformersModel(PaddedModel[CausalLMBatch]):
    """AutoModelForCausalLM behind the padded protocol; one shard (no tensor parallel)."""

    def __init__(
        self,
        model_path: Path,
        dtype: torch.dtype,
        device: torch.device,
        model_id: str,
        trust_remote_code: bool = False,
        why_padded: str = "",
    ) -> None:
        super().__init__()
        self.why_padded = why_padded
        """Why the model runs here and not on the paged engine (for /info and the log)."""
        self.device = device
        self.dtype = dtype
        self.model_id = model_id
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval()
        generation_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.info = TokenizerInfo.from_tokenizer(tokenizer, generation_eos)
        self.sampler = Sampler()

    def describe(self) -> pb.InfoResponse:
        config = self.model.config
        return pb.InfoResponse(
            requires_padding=True,
            dtype=str(self.dtype).removeprefix("torch."),
            device_type=self.device.type,
            block_size=0,
            max_position_embeddings=getattr(config, "max_position_embeddings", 0) or 0,
            model_id=self.model_id,
            model_type="transformers",
            model_implementation=(
                f"transformers {type(self.model).__name__}, padded ({self.why_padded})"
            ),
            world_size=1,
            weight_bytes=resident_bytes(self.model),
            cpu_kernels=cpu_kernel_report() if self.device.type == "cpu" else {},
        )

    def batch_from_pb(self, batch: pb.Batch) -> CausalLMBatch:
        return CausalLMBatch.from_pb(batch, self.info, self.device)

    def concatenate(self, batches: Seq[CausalLMBatch]) -> CausalLMBatch:
        return CausalLMBatch.concatenate(batches)

    def generate_token(self, batch: CausalLMBatch) -> StepOutput[CausalLMBatch]:
        start = time.perf_counter_ns()
        prefill = not batch.cache.layers or not batch.cache.layers[0].is_initialized
        want_prefill_logprobs = prefill and any(s.request.prefill_logprobs for s in batch.sequences)
        with torch.inference_mode():
            out = self.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                cache=batch.cache,
                use_cache=True,
                logits_to_keep=0 if want_prefill_logprobs else 1,
            )
            logits = out.logits.float()  # [B, S or 1, V]
            batch.cache = out.cache
            result = sample(self.sampler, logits[:, -1], batch.sequences, batch.sampling, self.info)
        forward_done = time.perf_counter_ns()
        generations, running = append_tokens(batch.sequences, result, self.info)
        if want_prefill_logprobs:
            self._add_prefill_logprobs(batch, logits, generations)
        batch.advance(result.next_ids)
        kept = batch.filter(running)
        return StepOutput(
            generations, kept, forward_done - start, time.perf_counter_ns() - forward_done
        )

    def _add_prefill_logprobs(
        self, batch: CausalLMBatch, logits: torch.Tensor, generations: list[pb.Generation]
    ) -> None:
        width = logits.shape[1]
        for row, seq in enumerate(batch.sequences):
            if not seq.request.prefill_logprobs:
                continue
            # Row logits at column c predict the token at column c + 1 (left padding).
            start = width - seq.prompt_len
            ids = torch.tensor(seq.all_ids[1 : seq.prompt_len], device=logits.device)
            logprobs = logits[row, start : width - 1].log_softmax(-1)  # [P-1, V]
            chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
            generations[row].prefill_tokens.CopyFrom(seq.prefill_tokens(chosen, self.info))
