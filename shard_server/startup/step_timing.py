"""Measure the shard's own step at startup (`--dtype auto` on CPU times its candidates with
the same measurement: `dtype_choice`).

What is measured (`measure_steps`), through `PagedModel.step` itself (forward, sampling,
detokenizing):
- a decode step at a few batch sizes (1, 8, 32, up to the router's max batch), every
  sequence holding DECODE_CONTEXT tokens of context. Those tokens' keys and values are
  never computed (the cache holds whatever it holds): attention costs the same over any
  values, and skipping the prefill that would fill them keeps the probe cheap;
- one prefill chunk of the router's step budget (at most MAX_PREFILL_CHUNK tokens).
Each step runs once untimed, then is timed until its two fastest runs agree
(`time_until_stable`), and its fastest run is reported: contention only ever adds time.
Decode steps a dtype trial already timed for the chosen dtype are not timed again.
The router derives its step budget, batch limit and inter-token-latency target from them;
a machine that looked busy while they were timed (`Contention`) has them timed again, up to
BUSY_RETRIES times, and is said so in the log when it stays busy.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from textgate.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from textgate.shard_server.startup.cache_config import CacheConfig
    from textgate.shard_server.startup.dtype_choice import DtypeChoice
    from textgate.shard_server.step.kv_cache import KVCache

log = logging.getLogger("textgate.shard")

MIN_RUNS = 3
"""Timed runs of each measured step at least (after one untimed run)."""
MAX_RUNS = 10
"""Timed runs of each measured step at most (a decode probe's positions advance per run)."""
AGREEMENT = 0.1
"""A step's timing is stable once its two fastest runs differ by at most this fraction."""
MAX_STEP_MS = 2000.0
"""Past MIN_RUNS a step is timed again only while its timed runs took less than this in
all: startup stays bounded however slow or noisy the step."""
BUSY_CPU_SHARE = 0.25
"""The machine looked busy when other processes kept this share of the CPUs this shard may
run on busy while it measured."""
BUSY_RETRIES = 2
"""Times the steps are measured again when the machine looked busy (a server started while
another one measures, a test run beside it): each step keeps its fastest over all tries."""
BUSY_RETRY_PAUSE_S = 1.0
"""The pause before such a try, for a passing burst of other work to end."""
MIN_CPU_WINDOW_S = 0.5
"""The shortest measurement whose CPU accounting (10 ms ticks) says anything."""
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


class MeasuredModel(Protocol):
    """What timing a step needs of a paged shard model: `PagedModel` (protocols/, a layer
    above this one, so named here by what it offers rather than imported)."""

    model: Any
    device: torch.device
    process_group: Any
    cache_config: CacheConfig
    kv_cache: KVCache | None
    dtype_choice: DtypeChoice

    def step(self, new_requests: Sequence[pb.Request], plan: pb.StepPlan) -> pb.StepResponse:
        """Run one router-planned step."""

    def clear(self, batch_id: int | None) -> None:
        """Drop every sequence (`batch_id` None)."""

    def num_blocks(self) -> int:
        """How many KV blocks fit in the memory the cache may take."""


@dataclass(frozen=True)
class StepTimings:
    """Milliseconds of the measured steps, each its fastest run (`time_until_stable`)."""

    decode_ms: dict[int, float]
    """Batch size -> decode step ms, ascending batch sizes."""
    prefill_tokens: int
    """Tokens of the measured prefill chunk."""
    prefill_ms: float
    """Milliseconds of that chunk's step."""
    busy: bool = False
    """Whether the machine looked busy while they were timed (`Contention.busy`): they may
    then be pessimistic."""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_ms * 1e3 if self.prefill_ms > 0 else 0.0

    def decode_pb(self) -> list[pb.DecodeTiming]:
        return [pb.DecodeTiming(batch_size=b, step_ms=ms) for b, ms in self.decode_ms.items()]

    def fastest(self, again: StepTimings) -> StepTimings:
        """Each step's faster time of these and the same steps timed `again` (contention
        only ever adds time); busy as `again` was."""
        return StepTimings(
            {b: min(ms, again.decode_ms[b]) for b, ms in self.decode_ms.items()},
            self.prefill_tokens,
            min(self.prefill_ms, again.prefill_ms),
            busy=again.busy,
        )


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
        decode = max(self.batch_sizes, default=0) * _blocks_for(self.context + MAX_RUNS, block_size)
        return max(decode, _blocks_for(self.prefill_tokens, block_size))


def probe_context(max_positions: int) -> int:
    """Context of a probe decode sequence: DECODE_CONTEXT, or less for short models."""
    return max(min(DECODE_CONTEXT, max_positions - MAX_RUNS - 1), 1)


def probe_capacity(num_blocks: int, block_size: int, max_positions: int) -> int:
    """How many probe decode sequences a cache of `num_blocks` holds at once."""
    return num_blocks // _blocks_for(probe_context(max_positions) + MAX_RUNS, block_size)


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


def measure_steps(model: MeasuredModel, plan: ProbePlan) -> StepTimings:
    """Time `plan`'s decode steps and prefill chunk in `model`'s allocated KV cache.

    Every shard of a tensor-parallel group runs the same steps in lockstep (each step is
    collective): every run's time is the slowest rank's, so all ranks run as many steps
    and agree on the timings. A machine that looked busy meanwhile (to any rank) has the
    steps timed again, up to BUSY_RETRIES times, each keeping its fastest time over the
    tries (contention only ever adds time); still busy after them is logged (WARNING).
    """
    timings, contention = _measure_once(model, plan)
    for _ in range(BUSY_RETRIES):
        if not timings.busy:
            break
        time.sleep(BUSY_RETRY_PAUSE_S)
        again, contention = _measure_once(model, plan)
        timings = timings.fastest(again)
    if timings.busy:
        log.warning(
            "The machine looked busy while the step was timed, %d times (last: %s): the "
            "timings may be pessimistic; the router's batch controller corrects them from "
            "served steps",
            1 + BUSY_RETRIES,
            contention.describe(),
        )
    return timings


def _measure_once(model: MeasuredModel, plan: ProbePlan) -> tuple[StepTimings, Contention]:
    """`measure_steps` without the retries: busy when any rank saw contention."""
    group, device = model.process_group, model.device
    before = CpuSample.now()
    decode = {batch: _time_decode(model, batch, plan.context, group) for batch in plan.batch_sizes}
    prefill = _time_prefill(model, plan.prefill_tokens, group)
    unstable = [f"decode at batch {b}" for b, t in decode.items() if not t.stable]
    if not prefill.stable:
        unstable.append(f"a {plan.prefill_tokens}-token prefill")
    contention = Contention.between(before, CpuSample.now(), group, device, tuple(unstable))
    # Ranks read /proc/stat apart: they must agree, or one would time again alone.
    (busy,) = _all_reduce([float(contention.busy)], group, device, "max")
    if busy:
        log.info("The machine looked busy while the step was timed (%s)", contention.describe())
    timings = StepTimings(
        {batch: t.ms for batch, t in decode.items()},
        plan.prefill_tokens,
        prefill.ms,
        busy=bool(busy),
    )
    return timings, contention


@dataclass(frozen=True)
class Timing:
    """One measured step: its fastest timed run, and whether its two fastest agreed."""

    ms: float
    num_runs: int
    stable: bool


def time_until_stable(run: Callable[[int], float]) -> Timing:
    """Time a step until its two fastest runs agree within AGREEMENT.

    `run(i)` runs the step's i-th repetition and returns its milliseconds; run 0 is
    untimed (caches, lazy initialisation). Then at least MIN_RUNS and at most MAX_RUNS
    timed runs, more than MIN_RUNS only while they took under MAX_STEP_MS in all.

    The fastest run is reported, not the median: contention (another process on the
    CPUs, a busy GPU) only ever adds time to a step, so the fastest run is the nearest to
    what the step costs on its own, and the median of runs taken on a busy machine is a
    busy time. Two fastest runs that agree say the step's own cost was seen; runs that
    never agree mean the machine was busy throughout (`stable` False), and the fastest
    is then still the best estimate there is. Contention steady enough to slow every run
    alike agrees with itself: that only the CPU accounting tells (`Contention`), and the
    router's batch controller corrects it from the steps it serves.
    """
    run(0)
    times: list[float] = []
    for index in range(1, MAX_RUNS + 1):
        times.append(run(index))
        if len(times) < MIN_RUNS:
            continue
        fastest, second = sorted(times)[:2]
        if second <= fastest * (1 + AGREEMENT):
            return Timing(fastest, len(times), stable=True)
        if sum(times) >= MAX_STEP_MS:
            break
    return Timing(min(times), len(times), stable=False)


def _time_decode(model: MeasuredModel, batch: int, context: int, group: Any) -> Timing:
    """A decode step of `batch` sequences at `context` tokens each (one more per run)."""
    block_size = model.cache_config.block_size
    per_seq = _blocks_for(context + MAX_RUNS, block_size)
    ids = [PROBE_FIRST_ID + i for i in range(batch)]
    prompt = [PROBE_TOKEN_ID] * context
    model.step([probe_request(rid, prompt, MAX_RUNS + 2) for rid in ids], pb.StepPlan())

    def run(index: int) -> float:
        plan = pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=rid,
                    token_ids=[PROBE_TOKEN_ID],
                    start_position=context - 1 + index,
                    block_table=range(i * per_seq, (i + 1) * per_seq),
                    produces_token=True,
                )
                for i, rid in enumerate(ids)
            ]
        )
        return _slowest_rank([_timed_step(model, [], plan)], group, model.device)[0]

    timing = time_until_stable(run)
    model.step([], pb.StepPlan(finished_ids=ids))
    return timing


def _time_prefill(model: MeasuredModel, tokens: int, group: Any) -> Timing:
    """One step computing a `tokens`-token prompt from position 0 (a new request per run)."""
    table = range(_blocks_for(tokens, model.cache_config.block_size))
    prompt = [PROBE_TOKEN_ID] * tokens

    def run(index: int) -> float:
        rid = PROBE_FIRST_ID + index
        chunk = pb.ScheduledRequest(
            request_id=rid, token_ids=prompt, block_table=table, produces_token=True
        )
        new = [probe_request(rid, prompt, 1)]
        ms = _timed_step(model, new, pb.StepPlan(scheduled=[chunk]))
        return _slowest_rank([ms], group, model.device)[0]

    return time_until_stable(run)


def _timed_step(model: MeasuredModel, new: list[pb.Request], plan: pb.StepPlan) -> float:
    start = time.perf_counter()
    model.step(new, plan)  # its sampled tokens reach the host: the device work is done
    return (time.perf_counter() - start) * 1e3


def _slowest_rank(values: list[float], group: Any, device: torch.device) -> list[float]:
    """`values` maximised element-wise over the process group (as is without one)."""
    return _all_reduce(values, group, device, "max")


def _all_reduce(values: list[float], group: Any, device: torch.device, op: str) -> list[float]:
    """`values` reduced element-wise ("max" or "sum") over the group (as is without one)."""
    if group is None:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)  # nccl: on the GPU
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor.tolist()


# -- was the machine busy? ---------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds spent so far on the CPUs this process may run on: by every process
    there (None where /proc/stat cannot be read) and by this one."""

    wall_s: float
    all_busy_s: float | None
    own_s: float
    num_cpus: int

    @classmethod
    def now(cls) -> CpuSample:
        cpus = _allowed_cpus()
        return cls(time.perf_counter(), _busy_seconds(cpus), time.process_time(), len(cpus))


def _allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _busy_seconds(cpus: set[int]) -> float | None:
    """Non-idle CPU seconds of `cpus` since boot, from Linux's /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            # user nice system idle iowait irq softirq steal (guest time is in user)
            user, nice, system, _, _, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK") if ticks else None


@dataclass(frozen=True)
class Contention:
    """What else ran while the steps were timed."""

    other_cpu_share: float | None
    """Share of this shard's CPUs other processes kept busy (None: unknown, or too short
    a measurement to tell). The shard's own ranks do not count as others."""
    load_average: float | None
    """The system's 1-minute load average at the end (our own threads included)."""
    num_cpus: int
    unstable: tuple[str, ...] = ()
    """The measured steps whose runs never agreed."""

    @property
    def busy(self) -> bool:
        share = self.other_cpu_share
        return bool(self.unstable) or (share is not None and share >= BUSY_CPU_SHARE)

    @classmethod
    def between(
        cls,
        before: CpuSample,
        after: CpuSample,
        group: Any,
        device: torch.device,
        unstable: tuple[str, ...] = (),
    ) -> Contention:
        """The contention between two samples; every rank's own CPU time is subtracted
        (ranks of one machine share its CPUs), so the group calls this together."""
        (ranks_s,) = _all_reduce([after.own_s - before.own_s], group, device, "sum")
        wall_s = after.wall_s - before.wall_s
        start, end, share = before.all_busy_s, after.all_busy_s, None
        if start is not None and end is not None and wall_s >= MIN_CPU_WINDOW_S:
            share = max(end - start - ranks_s, 0.0) / (wall_s * after.num_cpus)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        return cls(share, load, after.num_cpus, unstable)

    def describe(self) -> str:
        parts = []
        if self.other_cpu_share is not None:
            parts.append(
                f"other processes used {self.other_cpu_share:.0%} of its {self.num_cpus} CPUs"
            )
        if self.load_average is not None:
            parts.append(f"load average {self.load_average:.1f}")
        parts += [f"{step}: runs never agreed within {AGREEMENT:.0%}" for step in self.unstable]
        return "; ".join(parts)


# -- warmup ------------------------------------------------------------------------------


def warmup_measurements(model: MeasuredModel, request: pb.WarmupRequest) -> pb.WarmupResponse:
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
    trial = choice.trials[0].timings if choice.trials else None
    known = {b: ms for b, ms in (trial.decode_ms if trial else {}).items() if b in sizes}
    plan = ProbePlan.fit(
        [batch for batch in sizes if batch not in known],
        min(request.max_prefill_tokens or MAX_PREFILL_CHUNK, MAX_PREFILL_CHUNK),
        num_blocks=num_blocks,
        block_size=block_size,
        max_positions=max_positions,
    )
    measured = measure_steps(model, plan)
    model.clear()
    timings = StepTimings(
        dict(sorted({**known, **measured.decode_ms}.items())),
        measured.prefill_tokens,
        measured.prefill_ms,
        busy=measured.busy or bool(known and trial and trial.busy),
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
        "Measured at warmup in %.0f ms: decode step %s, prefill %.0f tokens/s (%d-token chunk)%s",
        response.measure_ms,
        ", ".join(f"{ms:.1f} ms at batch {b}" for b, ms in timings.decode_ms.items()),
        response.prefill_tokens_per_s,
        timings.prefill_tokens,
        " on a machine that looked busy" if timings.busy else "",
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
