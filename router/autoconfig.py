"""The router's defaults from what paged shards measured at warmup, and the report of them.

The shards time their own step at warmup (`shard_server/startup/step_timing.py`): a decode step at
a few batch sizes and a prefill chunk. Every setting below that the user left unset is
derived from those numbers; an explicit flag always wins and the rest derive around it.

- reference batch B: the largest measured batch <= --max-batch-size (32 when unset).
- --target-itl-ms starts at max(ITL_BATCH1_FACTOR x step(1), (1 + PREFILL_SHARE) x step(B),
  MIN_TARGET_ITL_MS) (`batch_controller.derived_target`). A loaded step must hold the
  reference batch's decodes plus a prompt chunk worth PREFILL_SHARE of them, or new requests
  would wait for the batch to drain; where batching is nearly free (GPUs: step(B) ~
  step(1)) the batch-1 factor gives prompts room instead and still promises a lone stream a
  quarter of its fastest rate. It is not frozen in the config: the batch controller's cost
  fit is seeded with the same measurements (`factory.startup_steps`) and applies the same
  rule to the served steps, so a measurement taken on a busy machine is corrected as the
  router serves. The two settings below derive around the starting value; both scale
  with the step time (a slower step raises the target and lowers the prefill rate alike),
  so a uniformly slowed measurement leaves them about where a quiet one would.
- --max-batch-prefill-tokens (tokens per step) = B + the prompt tokens the measured prefill
  rate computes in the headroom STEP_STRETCH x target - step(B) (the batch controller's
  longest step, one that catches up with waiting prompts; 1 x target with fixed budgets,
  where the ceiling alone holds the target), a multiple of the KV block, between
  MIN_STEP_TOKENS and TGI's max_input_tokens + 50, and at least the max batch size (every
  running request's decode must fit in one step).
- --max-batch-size = the largest batch whose decode step, on the least-squares line through
  the measured steps, stays within the target; at least B, at most MAX_DERIVED_BATCH_SIZE.

Pure Python: the rules test with synthetic timings.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from textgate.proto import generate_pb2 as pb
from textgate.router.config import RouterConfig
from textgate.router.engine import batch_controller

log = logging.getLogger("textgate.router")

ITL_BATCH1_FACTOR = batch_controller.DERIVE_FACTOR
"""The target is at least this many batch-1 decode steps."""
PREFILL_SHARE = batch_controller.PREFILL_SHARE
"""A loaded step may spend this fraction of the reference batch's decode step on prompts."""
MIN_TARGET_ITL_MS = batch_controller.MIN_DERIVED_TARGET_S * 1e3
"""The least target derivation gives (faster than any reader's eye needs)."""
REFERENCE_BATCH = 32
"""The reference batch when --max-batch-size is unset."""
MIN_STEP_TOKENS = 64
"""The least derived step budget: a chat prompt's chunk still makes progress."""
STEP_STRETCH = batch_controller.MAX_STRETCH
"""The adaptive controller's longest step, in targets: the step budget leaves it room. The
controller sizes every prompt share within the target itself; sized at 1 x the target, the
budget (64 tokens at 32 decodes on Zen 5) capped a burst of 32 chat prompts at about two
prompts a step, beside decodes or not (c=32 TTFT p99 4-5x its p50)."""
MAX_DERIVED_BATCH_SIZE = 256
"""The most a derived max batch size gives (the paged engine's default ceiling)."""
DERIVED = ("target_itl_ms", "max_batch_prefill_tokens", "max_batch_size")
"""RouterConfig fields this module derives when unset (the report's choices)."""
FILLED = ("max_batch_prefill_tokens", "max_batch_size")
"""Those it fills into the config; an unset target stays unset: the batch controller
derives it, starting where `target_itl_ms` puts it."""


@dataclass(frozen=True)
class Measurements:
    """What a paged shard reported in its WarmupResponse."""

    decode_step_ms: dict[int, float]
    """Batch size -> decode step ms (the fastest of runs that agreed), ascending batch
    sizes."""
    prefill_tokens_per_s: float
    prefill_chunk_tokens: int
    measure_ms: float
    """What measuring added to warmup."""
    device_name: str
    num_threads: int
    dtype: str
    dtype_source: str
    """How the dtype was picked: "flag", "default", "measured" or "quantization" (see
    generate.proto)."""
    dtype_trials: tuple[dict[str, Any], ...] = ()
    """`--dtype auto` on CPU: each candidate's trial as /info shows it, the chosen first."""

    def __post_init__(self) -> None:
        if not self.decode_step_ms or 1 not in self.decode_step_ms:
            raise ValueError("the measurements need a decode step at batch size 1")
        if any(ms <= 0 for ms in self.decode_step_ms.values()) or self.prefill_tokens_per_s <= 0:
            raise ValueError("measured step times and prefill rate must be positive")

    @classmethod
    def from_warmup(cls, warmup: pb.WarmupResponse) -> Measurements | None:
        """The measurements in `warmup`, or None where the shards measured nothing."""
        if not warmup.decode_timings:
            return None
        return cls(
            decode_step_ms={
                t.batch_size: t.step_ms
                for t in sorted(warmup.decode_timings, key=lambda t: t.batch_size)
            },
            prefill_tokens_per_s=warmup.prefill_tokens_per_s,
            prefill_chunk_tokens=warmup.prefill_chunk_tokens,
            measure_ms=warmup.measure_ms,
            device_name=warmup.device_name,
            num_threads=warmup.num_threads,
            dtype=warmup.dtype,
            dtype_source=warmup.dtype_source,
            dtype_trials=tuple(_trial_dict(t) for t in warmup.dtype_trials),
        )


def _trial_dict(trial: pb.DtypeTrial) -> dict[str, Any]:
    return {
        "dtype": trial.dtype,
        "decode_step_ms": _timings_list({t.batch_size: t.step_ms for t in trial.decode_timings}),
        "prefill_chunk_tokens": trial.prefill_chunk_tokens,
        "prefill_chunk_ms": round(trial.prefill_chunk_ms, 2),
        "score_ms": round(trial.score_ms, 2),
    }


def _timings_list(decode_step_ms: dict[int, float]) -> list[dict[str, Any]]:
    return [{"batch_size": b, "step_ms": round(ms, 2)} for b, ms in decode_step_ms.items()]


# -- the rules ------------------------------------------------------------------------------


def reference_batch(m: Measurements, max_batch_size: int | None) -> int:
    """The largest measured batch <= max_batch_size (REFERENCE_BATCH when unset)."""
    limit = max_batch_size or REFERENCE_BATCH
    return max((b for b in m.decode_step_ms if b <= limit), default=1)


def target_itl_ms(m: Measurements, reference: int) -> float:
    """max(ITL_BATCH1_FACTOR x step(1), (1 + PREFILL_SHARE) x step(reference), the floor):
    where the batch controller's target starts."""
    target = batch_controller.derived_target(
        m.decode_step_ms[1],
        m.decode_step_ms[reference],
        factor=ITL_BATCH1_FACTOR,
        prefill_share=PREFILL_SHARE,
        floor=MIN_TARGET_ITL_MS,
    )
    return round(target, 1)


def max_batch_size(m: Measurements, target_ms: float, reference: int) -> int:
    """The largest batch whose fitted decode step stays within `target_ms`."""
    slope, intercept = _fit_line(m.decode_step_ms)
    # A flat or falling line (batching is free, or noise): the ceiling.
    fitted = MAX_DERIVED_BATCH_SIZE if slope <= 0 else math.floor((target_ms - intercept) / slope)
    return min(max(fitted, reference), MAX_DERIVED_BATCH_SIZE)


def _fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of step ms over batch size; slope 0 for one point."""
    n = len(points)
    mean_x = sum(points) / n
    mean_y = sum(points.values()) / n
    var = sum((x - mean_x) ** 2 for x in points)
    if var == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / var
    return slope, mean_y - slope * mean_x


def step_tokens(
    m: Measurements,
    target_ms: float,
    reference: int,
    *,
    batch_size: int,
    block_size: int,
    max_input_tokens: int,
) -> int:
    """Tokens per step: the reference batch's decodes plus the prompt tokens that fit in
    the target's headroom over its decode step, bounded (see the module docstring)."""
    headroom_ms = max(target_ms - m.decode_step_ms[reference], 0.0)
    tokens = reference + int(headroom_ms * m.prefill_tokens_per_s / 1e3)
    if block_size > 0:
        tokens -= tokens % block_size
    tokens = min(max(tokens, MIN_STEP_TOKENS), max_input_tokens + 50)
    return max(tokens, batch_size)


@dataclass(frozen=True)
class Derived:
    """The derived settings (before explicit flags replace any of them)."""

    target_itl_ms: float
    max_batch_prefill_tokens: int
    max_batch_size: int
    reference_batch: int


def derive(config: RouterConfig, m: Measurements, block_size: int) -> Derived:
    """Every rule applied, each around the settings the user gave explicitly."""
    reference = reference_batch(m, config.max_batch_size)
    target = target_itl_ms(m, reference)
    # An explicit target (0 = fixed budgets: no target to size around) shapes the rest.
    effective_target = config.target_itl_ms or target
    batch = config.max_batch_size or max_batch_size(m, effective_target, reference)
    stretch = 1.0 if config.target_itl_ms == 0 else STEP_STRETCH
    tokens = step_tokens(
        m,
        stretch * effective_target,
        reference,
        batch_size=batch,
        block_size=block_size,
        max_input_tokens=config.max_input_tokens,
    )
    return Derived(target, tokens, batch, reference)


def apply_measurements(config: RouterConfig, m: Measurements, block_size: int) -> RouterConfig:
    """`config` with the step budget and max batch size filled in where the user left them
    unset (None); an unset target stays None: the batch controller derives it (FILLED)."""
    derived = derive(config, m, block_size)
    unset = {name: getattr(derived, name) for name in FILLED if getattr(config, name) is None}
    return dataclasses.replace(config, **unset)


# -- the report ------------------------------------------------------------------------------


def report(requested: RouterConfig, resolved: RouterConfig, m: Measurements) -> dict[str, Any]:
    """The startup report /info shows under "autoconfig" and the router logs: the machine,
    each choice with where it came from ("flag" or "measured"), and the numbers. A
    measured target is where the batch controller starts (/metrics shows where it is)."""
    values = {name: getattr(resolved, name) for name in DERIVED}
    if values["target_itl_ms"] is None:
        values["target_itl_ms"] = target_itl_ms(m, reference_batch(m, requested.max_batch_size))
    choices = {
        name: {
            "value": values[name],
            "source": "flag" if getattr(requested, name) is not None else "measured",
        }
        for name in DERIVED
    }
    return {
        "device": m.device_name,
        "threads": m.num_threads,
        "dtype": {"value": m.dtype, "source": m.dtype_source, "trials": list(m.dtype_trials)},
        **choices,
        "reference_batch_size": reference_batch(m, resolved.max_batch_size),
        "measured": {
            "decode_step_ms": _timings_list(m.decode_step_ms),
            "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 1),
            "prefill_chunk_tokens": m.prefill_chunk_tokens,
            "measure_ms": round(m.measure_ms, 1),
        },
    }


def log_report(data: dict[str, Any]) -> None:
    """One INFO block: the machine, the choices, the numbers they came from."""
    measured = data["measured"]
    dtype = data["dtype"]
    trials = ", ".join(f"{t['dtype']} score {t['score_ms']} ms" for t in dtype["trials"])
    lines = [
        f"Startup autoconfig on {data['device']} ({data['threads']} threads):",
        f"  dtype {dtype['value']} ({dtype['source']}{': ' + trials if trials else ''})",
        *(f"  {name} {data[name]['value']} ({data[name]['source']})" for name in DERIVED),
        "  measured in {:.0f} ms: decode step {}; prefill {:.0f} tokens/s ({}-token chunk); "
        "reference batch {}".format(
            measured["measure_ms"],
            ", ".join(
                f"{t['step_ms']} ms at {t['batch_size']}" for t in measured["decode_step_ms"]
            ),
            measured["prefill_tokens_per_s"],
            measured["prefill_chunk_tokens"],
            data["reference_batch_size"],
        ),
    ]
    log.info("\n".join(lines))
