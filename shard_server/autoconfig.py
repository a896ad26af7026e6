"""Measure the shard's own step at startup (`--dtype auto` on CPU times its candidates with
the same measurement: `dtype_choice`).

What is measured (`measure_steps`), each as the median of REPEATS timed runs after one
untimed run, through `PagedModel.step` itself (forward, sampling, detokenizing):
- a decode step at a few batch sizes (1, 8, 32, up to the router's max batch), every
  sequence holding DECODE_CONTEXT tokens of context. Those tokens' keys and values are
  never computed (the cache holds whatever it holds): attention costs the same over any
  values, and skipping the prefill that would fill them keeps the probe cheap;
- one prefill chunk of the router's step budget (at most MAX_PREFILL_CHUNK tokens).
Decode steps a dtype trial already timed for the chosen dtype are not timed again.
The router derives its step budget, batch limit and inter-token-latency target from them.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from textgate.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from textgate.shard_server.paged_model import PagedModel

log = logging.getLogger("textgate.shard")

REPEATS = 3
"""Timed runs of each measured step (after one untimed run); the median is reported."""
DECODE_BATCH_SIZES = (1, 8, 32)
"""Decode batch sizes measured at warmup (those up to the router's max batch, plus it)."""
DEFAULT_MAX_BATCH = 32
"""The largest decode batch measured when the router sets no max batch size."""
MAX_MEASURED_BATCH = 256
"""The largest decode batch measured whatever the max batch (bounds the startup cost)."""
DECODE_CONTEXT = 128
"""Tokens of context each measured decode sequence holds."""
MAX_PREFILL_CHUNK = 512
"""The largest prefill chunk measured at warmup (the router's budget may be larger)."""
PROBE_TOKEN_ID = 0
"""Any id every vocabulary has; the probe only needs the shapes."""
PROBE_FIRST_ID = 1 << 62
"""Request ids of the probe's sequences start here, far from the router's."""


@dataclass(frozen=True)
class StepTimings:
    """Median milliseconds of the measured steps."""

    decode_ms: dict[int, float]
    """Batch size -> decode step ms, ascending batch sizes."""
    prefill_tokens: int
    """Tokens of the measured prefill chunk."""
    prefill_ms: float
    """Milliseconds of that chunk's step."""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_ms * 1e3 if self.prefill_ms > 0 else 0.0

    def decode_pb(self) -> list[pb.DecodeTiming]:
        return [pb.DecodeTiming(batch_size=b, step_ms=ms) for b, ms in self.decode_ms.items()]


def decode_batch_sizes(max_batch: int, capacity: int) -> list[int]:
    """The decode batch sizes to time: DECODE_BATCH_SIZES up to `max_batch` (0: unset, then
    DEFAULT_MAX_BATCH) and `max_batch` itself, all within `capacity` probe sequences and
    MAX_MEASURED_BATCH."""
    limit = min(max_batch or DEFAULT_MAX_BATCH, capacity, MAX_MEASURED_BATCH)
    if limit < 1:
        raise ValueError("the KV cache cannot hold one probe sequence")
    return sorted({b for b in DECODE_BATCH_SIZES if b <= limit} | {limit})


@dataclass(frozen=True)
class ProbePlan:
    """What `measure_steps` times, sized to fit the cache and the model's positions."""

    batch_sizes: tuple[int, ...]
    context: int
    prefill_tokens: int

    @classmethod
    def fit(
        cls,
        batch_sizes: Sequence[int],
        prefill_tokens: int,
        *,
        num_blocks: int,
        block_size: int,
        max_positions: int,
    ) -> ProbePlan:
        """The plan for a cache of `num_blocks`: the context shortened to fit the model's
        positions, batch sizes beyond the cache dropped, the chunk capped by both."""
        context = probe_context(max_positions)
        capacity = probe_capacity(num_blocks, block_size, max_positions)
        if capacity < 1:
            raise ValueError(f"a cache of {num_blocks} blocks cannot hold one probe sequence")
        batches = tuple(b for b in batch_sizes if b <= capacity)
        chunk = min(prefill_tokens, num_blocks * block_size, max_positions - 1)
        return cls(batches, context, max(chunk, 1))

    def num_blocks(self, block_size: int) -> int:
        """Blocks the plan's steps touch (block ids below this)."""
        decode = max(self.batch_sizes, default=0) * _blocks_for(self.context + REPEATS, block_size)
        return max(decode, _blocks_for(self.prefill_tokens, block_size))


def probe_context(max_positions: int) -> int:
    """Context of a probe decode sequence: DECODE_CONTEXT, or less for short models."""
    return max(min(DECODE_CONTEXT, max_positions - REPEATS - 1), 1)


def probe_capacity(num_blocks: int, block_size: int, max_positions: int) -> int:
    """How many probe decode sequences a cache of `num_blocks` holds at once."""
    return num_blocks // _blocks_for(probe_context(max_positions) + REPEATS, block_size)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def probe_request(request_id: int, prompt: list[int], max_new_tokens: int) -> pb.Request:
    """A greedy request that ignores EOS: it runs exactly as many steps as it is given."""
    return pb.Request(
        id=request_id,
        input_ids=prompt,
        parameters=pb.NextTokenChooserParameters(
            temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, ignore_eos_token=True
        ),
    )


def measure_steps(model: PagedModel, plan: ProbePlan) -> StepTimings:
    """Time `plan`'s decode steps and prefill chunk in `model`'s allocated KV cache.

    Every shard of a tensor-parallel group runs the same steps in lockstep (each step is
    collective); the timings are then the slowest rank's, so all ranks agree on them.
    """
    decode = {batch: _time_decode(model, batch, plan.context) for batch in plan.batch_sizes}
    prefill = _time_prefill(model, plan.prefill_tokens)
    values = _slowest_rank([*decode.values(), prefill], model.process_group, model.device)
    return StepTimings(dict(zip(decode, values[:-1], strict=True)), plan.prefill_tokens, values[-1])


def _time_decode(model: PagedModel, batch: int, context: int) -> float:
    """Median ms of a decode step of `batch` sequences at `context` tokens each."""
    block_size = model.cache_config.block_size
    per_seq = _blocks_for(context + REPEATS, block_size)
    ids = [PROBE_FIRST_ID + i for i in range(batch)]
    prompt = [PROBE_TOKEN_ID] * context
    model.step([probe_request(rid, prompt, REPEATS + 2) for rid in ids], pb.StepPlan())
    times = []
    for run in range(REPEATS + 1):
        plan = pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=rid,
                    token_ids=[PROBE_TOKEN_ID],
                    start_position=context - 1 + run,
                    block_table=range(i * per_seq, (i + 1) * per_seq),
                    produces_token=True,
                )
                for i, rid in enumerate(ids)
            ]
        )
        times.append(_timed_step(model, [], plan))
    model.step([], pb.StepPlan(finished_ids=ids))
    return statistics.median(times[1:])


def _time_prefill(model: PagedModel, tokens: int) -> float:
    """Median ms of one step computing a `tokens`-token prompt from position 0."""
    table = range(_blocks_for(tokens, model.cache_config.block_size))
    prompt = [PROBE_TOKEN_ID] * tokens
    times = []
    for run in range(REPEATS + 1):
        rid = PROBE_FIRST_ID + run
        chunk = pb.ScheduledRequest(
            request_id=rid, token_ids=prompt, block_table=table, produces_token=True
        )
        times.append(
            _timed_step(model, [probe_request(rid, prompt, 1)], pb.StepPlan(scheduled=[chunk]))
        )
    return statistics.median(times[1:])


def _timed_step(model: PagedModel, new: list[pb.Request], plan: pb.StepPlan) -> float:
    start = time.perf_counter()
    model.step(new, plan)  # its sampled tokens reach the host: the device work is done
    return (time.perf_counter() - start) * 1e3


def _slowest_rank(values: list[float], group: Any, device: torch.device) -> list[float]:
    """`values` maximised element-wise over the process group (as is without one)."""
    if group is None:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)  # nccl: on the GPU
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


# -- warmup ------------------------------------------------------------------------------


def warmup_measurements(model: PagedModel, request: pb.WarmupRequest) -> pb.WarmupResponse:
    """Time the decode steps and a prefill chunk the router's limits call for, in the
    allocated cache; the answer's capacity fields are the caller's to fill."""
    start = time.perf_counter()
    num_blocks = model.kv_cache.num_blocks if model.kv_cache is not None else 0
    block_size = model.cache_config.block_size
    max_positions = model.model.config.max_position_embeddings
    sizes = decode_batch_sizes(
        request.max_batch_size, probe_capacity(num_blocks, block_size, max_positions)
    )
    choice = model.dtype_choice
    # A dtype trial timed the chosen model at some of these batch sizes, in the same
    # geometry (context, block ids): those steps are not timed twice.
    trial = choice.trials[0].timings.decode_ms if choice.trials else {}
    known = {batch: ms for batch, ms in trial.items() if batch in sizes}
    plan = ProbePlan.fit(
        [batch for batch in sizes if batch not in known],
        min(request.max_prefill_tokens or MAX_PREFILL_CHUNK, MAX_PREFILL_CHUNK),
        num_blocks=num_blocks,
        block_size=block_size,
        max_positions=max_positions,
    )
    measured = measure_steps(model, plan)
    model.clear(None)
    timings = StepTimings(
        dict(sorted({**known, **measured.decode_ms}.items())),
        measured.prefill_tokens,
        measured.prefill_ms,
    )
    response = pb.WarmupResponse(
        decode_timings=timings.decode_pb(),
        prefill_tokens_per_s=timings.prefill_tokens_per_s,
        prefill_chunk_tokens=timings.prefill_tokens,
        measure_ms=(time.perf_counter() - start) * 1e3,
        device_name=device_name(model.device),
        num_threads=torch.get_num_threads(),
        dtype=dtype_name(choice.dtype),
        dtype_source=choice.source,
        dtype_trials=[trial.to_pb() for trial in choice.trials],
    )
    log.info(
        "Measured at warmup in %.0f ms: decode step %s, prefill %.0f tokens/s (%d-token chunk)",
        response.measure_ms,
        ", ".join(f"{ms:.1f} ms at batch {b}" for b, ms in timings.decode_ms.items()),
        response.prefill_tokens_per_s,
        timings.prefill_tokens,
    )
    return response


# -- naming ------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name without "torch.", e.g. bfloat16."""
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (Linux's /proc/cpuinfo, else platform's)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
