"""`--dtype auto` on a CPU: build the model in each candidate dtype, time its step, keep the fastest.

Whether bf16 beats fp32 depends on the CPU, its matmul library and the batch (on a Xeon
with AVX512-BF16 and no AMX a plain bf16 matmul was slower than fp32, yet the engine's
batch-1 step was faster in bf16 and its batch-32 step slower), so CPU flags cannot tell.
Each candidate is built by the same loader that serves it and its step timed
(`trial_timings`, with `step_timing.measure_steps`); the lowest `dtype_score` wins
(`pick_dtype`). A trial the machine disturbed (still busy after its retries) would hand
the other candidate a win it did not earn, so then the two models at hand are timed again
back to back, each keeping its faster times. The model keeps how its dtype was chosen (`DtypeChoice`), which its warmup
reports to the router.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.startup.step_timing import (
    MeasuredModel,
    ProbePlan,
    StepTimings,
    dtype_name,
    measure_steps,
)

Model = TypeVar("Model", bound=MeasuredModel)

log = logging.getLogger("textgate.shard")

TRIAL_BATCH_SIZES = (1, 32)
"""Decode batch sizes of a dtype trial: a lone stream's step and a loaded batch's."""
TRIAL_PREFILL_CHUNK = 128
"""Tokens of a dtype trial's prefill chunk."""
CPU_DTYPE_CANDIDATES = (torch.float32, torch.bfloat16)
"""What `--dtype auto` tries on CPU. float32 first: the widest, so the trial's cache
geometry, planned on it, fits every candidate; a tie keeps it."""


def dtype_score(timings: StepTimings) -> float:
    """The number `--dtype auto` minimises: the sum of the trial's step times.

    A trial times one step of each kind a serving loop runs (a lone stream's decode, a
    loaded batch's decode, a prompt chunk), so the sum weighs them equally, each by what
    it costs in this dtype.
    """
    return sum(timings.decode_ms.values()) + timings.prefill_ms


@dataclass(frozen=True)
class DtypeTrial:
    """The engine's step measured in one candidate dtype."""

    dtype: torch.dtype
    timings: StepTimings

    @property
    def score_ms(self) -> float:
        return dtype_score(self.timings)

    def to_pb(self) -> pb.DtypeTrial:
        return pb.DtypeTrial(
            dtype=dtype_name(self.dtype),
            decode_timings=self.timings.decode_pb(),
            prefill_chunk_ms=self.timings.prefill_ms,
            prefill_chunk_tokens=self.timings.prefill_tokens,
            score_ms=self.score_ms,
        )


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the weights run in, and how it was picked."""

    dtype: torch.dtype
    source: str
    """One of "flag" (an explicit --dtype), "default" (auto, not measured), "measured",
    "quantization" (auto: the dtype the quantization method's CPU kernel runs in)."""
    trials: tuple[DtypeTrial, ...] = ()
    """Source "measured": every candidate's trial, the chosen one first."""


def choose_dtype(trials: Sequence[DtypeTrial]) -> DtypeChoice:
    """The trial with the lowest score wins (a tie goes to the earlier one).

    Raises ValueError unless the trials timed the same steps (else scores differ in kind).
    """
    if not trials:
        raise ValueError("no dtype trials to choose from")
    shapes = {(tuple(t.timings.decode_ms), t.timings.prefill_tokens) for t in trials}
    if len(shapes) > 1:
        raise ValueError(f"dtype trials timed different steps: {sorted(shapes)}")
    best = min(trials, key=lambda trial: trial.score_ms)
    return DtypeChoice(best.dtype, "measured", (best, *(t for t in trials if t is not best)))


def pick_dtype(
    build: Callable[[torch.dtype], Model],
    candidates: Sequence[torch.dtype] = CPU_DTYPE_CANDIDATES,
) -> Model:
    """Build the model in each candidate dtype, time its step, keep the fastest.

    Each candidate is built by `build` (the loader serving uses: its weights are packed
    for that dtype, so a cast of another candidate would not time what serves), timed in
    a small cache of its own, and the slower of the two models at hand is freed before
    the next is built: at most two copies of the weights exist at once. When either of
    those two trials was disturbed (`StepTimings.busy`), both models are timed again, one
    after the other, before the slower goes (`_retimed`).
    """
    trials: dict[torch.dtype, DtypeTrial] = {}
    best: Model | None = None
    best_dtype: torch.dtype | None = None
    plan: ProbePlan | None = None
    start = time.perf_counter()
    building = 0.0
    for dtype in candidates:
        built = time.perf_counter()
        model = build(dtype)
        building += time.perf_counter() - built
        plan = plan or trial_plan(model)
        trials[dtype] = DtypeTrial(dtype, trial_timings(model, plan))
        if best is not None and best_dtype is not None:
            trials |= _retimed(trials, {best_dtype: best, dtype: model}, plan)
        if choose_dtype(list(trials.values())).dtype == dtype:
            best, best_dtype = model, dtype
        del model
        gc.collect()  # the loser's weights go now, before the next candidate loads
    assert best is not None
    best.dtype_choice = choose_dtype(list(trials.values()))
    log.info(
        "--dtype auto: %s (%.1f s: building %.1f s, timing %.1f s; score = decode steps at "
        "batch %s + a %d-token prefill: %s)",
        dtype_name(best.model.dtype),
        time.perf_counter() - start,
        building,
        time.perf_counter() - start - building,
        " and ".join(str(b) for b in best.dtype_choice.trials[0].timings.decode_ms),
        best.dtype_choice.trials[0].timings.prefill_tokens,
        ", ".join(f"{dtype_name(t.dtype)} {t.score_ms:.1f} ms" for t in trials.values()),
    )
    return best


def _retimed(
    trials: dict[torch.dtype, DtypeTrial], pair: dict[torch.dtype, Model], plan: ProbePlan
) -> dict[torch.dtype, DtypeTrial]:
    """The trials of `pair` (the best model so far and the one just timed, by dtype) timed
    again back to back when either was disturbed, each keeping its faster times; none
    changed otherwise."""
    if not any(trials[dtype].timings.busy for dtype in pair):
        return {}
    log.info(
        "--dtype auto: a trial was disturbed; timing %s again",
        " and ".join(dtype_name(dtype) for dtype in pair),
    )
    return {
        dtype: DtypeTrial(dtype, trials[dtype].timings.fastest(trial_timings(m, plan)))
        for dtype, m in pair.items()
    }


def trial_plan(model: MeasuredModel) -> ProbePlan:
    """A dtype trial's steps, within the memory the cache may take in `model`'s dtype."""
    block_size = model.cache_config.block_size
    return ProbePlan.fit(
        TRIAL_BATCH_SIZES,
        TRIAL_PREFILL_CHUNK,
        num_blocks=model.num_blocks(),
        block_size=block_size,
        max_positions=model.model.config.max_position_embeddings,
    )


def trial_timings(model: MeasuredModel, plan: ProbePlan) -> StepTimings:
    """`plan`'s timings in a cache allocated for the trial and dropped after it."""
    block_size = model.cache_config.block_size
    model.kv_cache = model.model.allocate_kv_cache(plan.num_blocks(block_size), block_size)
    try:
        return measure_steps(model, plan)
    finally:
        model.clear()
        model.kv_cache = None
