"""The batch controller: each step's prefill share and batch limit, from measured steps.

Every step the scheduler asks it two things and tells it one:

    budget = controller.plan_prefill(num_decodes, context)   # prompt tokens beside the decodes
    limit = controller.batch_limit                  # most running requests (joins stop there)
    controller.observe(StepSample(...))             # what the step cost, and the queue after it

It fits what a step costs (`step_cost.StepCostModel`: overhead + per decode + per prompt
token) to the measured steps and keeps every step under an inter-token-latency target:

- prefill share: the prompt tokens that still fit beside this step's decodes, never below
  what `min_prefill_tokens` cost from position 0 (waiting prompts always progress; deep in a
  long prompt that is fewer tokens, `_least_share`) nor above the step ceiling; a step
  without decodes delays nobody's next token, so it gets the ceiling. The fit counts the
  attention a chunk computes over the keys before it (`step_cost.attention_pairs`), so the
  chunks of a long prompt get smaller as they move down it (`context`: where the step's
  first chunk starts) and the streams beside them keep their pace;
- batch limit: grows while requests wait and the limit is what holds them back, up to the
  largest batch whose step, with the smallest prefill share beside it, is predicted to meet
  the target. It doubles per step, and goes straight there while the device is under-used
  (utilization below `low_utilization`); it never grows while the KV cache is nearly full
  (admission is then limited by blocks, and more requests only bring preemptions sooner).
  It shrinks toward that largest batch (at most halving per step, so one noisy fit cannot
  collapse it) once its own step is predicted over the target by more than the dead band
  and a measured step of at least half its decodes ran over it too, less the prompt tokens
  it took past the smallest share (a step stretched to catch up with waiting prompts is
  no evidence against the batch; a prediction for a
  batch that is not running is an extrapolation, and slow steps of a few requests while a
  burst arrives bent it),
  but never below `min_batch_size` (it guards against overload, not a modest load). A prediction that would break the target thus cuts the prefill share
  first (every mixed step), then the batch.

A time-to-first-token target stands beside it (`target_ttft_s`, else `TTFT_STEPS` inter-
token targets): when the prompt tokens waiting (the queue's and the unfinished prefill's,
`first_token.Backlog`) cannot all be computed before the oldest of them is past that target at the
step's share, the share grows to what would clear them in time, up to what fits in
`max_stretch` inter-token targets. A burst of prompts then waits a bounded time instead
of ~20 steps behind the decodes; the decodes' steps stretch, boundedly, only while a
prompt would otherwise miss its target (goodput needs both), and never for one already
past it or that could not make it even so (its request is lost to goodput; the streams'
pace is not). A prompt late, or clearly out of reach (1.5x the time it has left even at the
stretched share), is judged lost for good: it is not waited for later, when what is left of
it looks feasible (a long prompt near its end), for it will miss anyway. The age of a request is
measured on the controller's own clock, the sum of the steps' latencies (`clock_s`).

Between growing (at the target) and shrinking (past target × (1 + dead_band)) it holds, so a
steady load settles on one limit instead of oscillating. Queue age is the scheduler's: a
request that waited `max_waiting_steps` joins past the limit (bounded queue time).

The target: an explicit one (`target_itl_s`) is kept as given. Otherwise it is derived from
the fit and re-derived after every step, so it follows the machine: `derived_target` of the
fitted decode step at batch 1 and at the reference batch, the rule the router's startup
autoconfig applies to the shards' own measurement. It moves only on steps that spread their
batch (`min_decode_spread`): steps of one batch size cannot tell the per-decode cost from
the overhead, and the fit's split of the two wanders with whatever else their latency
holds. Seeded with that measurement (`StartupSteps`), the fit starts from it as a prior
that served steps outweigh
(`StepCostModel.seed`): target and limits hold from the first step, and a measurement taken
on a busy machine (decode steps 2-3x too slow, so a target 3x too loose) is corrected
within about ten served steps once the load varies its batch (a load held at one batch
size pins the step at that size; the slope follows when the batch moves). Without a seed the batch limit starts at `initial_batch_size` and
doubles while requests wait (small batches first, so the batch-1 step is measured, not
guessed); the first target comes after `num_calibration_steps` steps with decodes.
With `adaptive=False` the limits stay at their maxima (the scheduler's fixed budgets) and the
controller only measures. Pure Python: no I/O beyond its log lines, no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from textgate.router.engine.first_token import Backlog, FirstTokenDeadlines
from textgate.router.engine.step_cost import StepCostModel

log = logging.getLogger("textgate.router")

DERIVE_FACTOR = 4.0
"""A derived target is at least this many batch-1 decode steps."""
PREFILL_SHARE = 0.5
"""A derived target leaves the reference batch's decode step this share of it for prompts."""
MIN_DERIVED_TARGET_S = 0.02
"""The least target derivation gives (faster than any reader's eye needs)."""
MIN_DECODE_SPREAD = 0.125
"""A derived target moves only on steps whose decode counts spread (standard deviation) over
this fraction of the reference batch: steps of one batch size cannot tell the per-decode
cost from the overhead, and a target extrapolated from them wandered 41 -> 84 ms while 8
streams ran beside a long prompt (its chunks' cost leaking into the split), and to 129 ms
once a ninth, 2,900-token decode made its steps 25 ms against 14 (the fit read it as a
steep per-decode cost; 2-core Zen 5)."""
TTFT_STEPS = 16.0
"""A derived time-to-first-token target is this many inter-token targets."""
MAX_STRETCH = 2.0
"""A step that catches up with waiting prompts takes at most this many inter-token targets."""
TARGET_LOG_CHANGE = 0.2
"""A derived target is logged (INFO) when first set and when it moved this fraction."""


def derived_target(
    batch_one: float,
    reference: float,
    *,
    factor: float = DERIVE_FACTOR,
    prefill_share: float = PREFILL_SHARE,
    floor: float = MIN_DERIVED_TARGET_S,
) -> float:
    """max(factor x batch-1 decode step, (1 + prefill_share) x reference-batch decode step,
    floor), all in one unit.

    A loaded step must hold the reference batch's decodes plus a prompt chunk worth
    `prefill_share` of them, or new requests wait for the batch to drain; where batching is
    nearly free (GPUs: step(B) ~ step(1)) the batch-1 term gives prompts room instead and
    still promises a lone stream 1/factor of its fastest rate.
    """
    return max(factor * batch_one, (1 + prefill_share) * reference, floor)


@dataclass(frozen=True)
class StartupSteps:
    """The steps the shards timed at warmup (`shard_server/startup/step_timing.py`), in seconds: the
    prior the cost fit starts from."""

    decode_s: Mapping[int, float]
    """Batch size -> decode step."""
    prefill_tokens: int = 0
    """Tokens of the timed prefill chunk (0: none timed)."""
    prefill_s: float = 0.0
    """That chunk's step."""

    def __post_init__(self) -> None:
        if not self.decode_s or min(self.decode_s) < 1:
            raise ValueError("startup steps need decode steps at batch sizes >= 1")
        if any(s <= 0 for s in self.decode_s.values()) or self.prefill_s < 0:
            raise ValueError("startup step times must be positive")

    def samples(self) -> list[tuple[int, int, float]]:
        """(decodes, prompt tokens, latency) of each timed step."""
        steps = [(batch, 0, s) for batch, s in self.decode_s.items()]
        if self.prefill_tokens > 0 and self.prefill_s > 0:
            steps.append((0, self.prefill_tokens, self.prefill_s))
        return steps

    def reference_batch(self, max_batch_size: int) -> int:
        """The largest timed batch within `max_batch_size` (1 when none is)."""
        return max((batch for batch in self.decode_s if batch <= max_batch_size), default=1)


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's bounds and tuning; built by the scheduler from its config."""

    max_prefill_tokens: int
    """Ceiling of the prefill share (the step's token ceiling, --max-batch-prefill-tokens)."""
    max_batch_size: int
    """Ceiling of the batch limit (the scheduler's max_num_seqs)."""
    adaptive: bool = True
    """False: prefill share and batch limit stay at their ceilings (fixed budgets)."""
    target_itl_s: float | None = None
    """Inter-token latency each step aims at; None = derived from the first measured steps."""
    target_ttft_s: float | None = None
    """Time to first token the prefill share defends; None = `ttft_steps` x the ITL target."""
    ttft_steps: float = TTFT_STEPS
    """A derived TTFT target is this many inter-token targets."""
    max_stretch: float = MAX_STRETCH
    """A step catching up with waiting prompts is planned within this x the ITL target."""
    min_prefill_tokens: int = 32
    """Floor of the prefill share whenever prompts wait, so they always progress."""
    initial_batch_size: int = 4
    """The batch limit before any step was measured (at least `min_batch_size`)."""
    min_batch_size: int = 16
    """The batch limit never goes below this: the limit protects inter-token latency under
    overload, it must not starve a modest load. Without a floor a contended or noisy fit
    once pinned the limit at 1 while 8 requests waited up to 115 s (a 300-request soak on a
    2-core CPU shared with other jobs)."""
    dead_band: float = 0.1
    """The limit shrinks only once a step is predicted over target × (1 + dead_band)."""
    derive_factor: float = DERIVE_FACTOR
    """A derived target is at least this many batch-1 decode steps (`derived_target`)."""
    prefill_share: float = PREFILL_SHARE
    """A derived target is at least (1 + this) reference-batch decode steps."""
    min_derived_target_s: float = MIN_DERIVED_TARGET_S
    """The least target derivation may give."""
    min_decode_spread: float = MIN_DECODE_SPREAD
    """A derived target moves only while the served steps' decode counts spread (standard
    deviation, `StepCostModel.decode_spread`) over this fraction of the reference batch."""
    num_calibration_steps: int = 16
    """Measured steps with decodes before a target is derived."""
    high_kv_usage: float = 0.9
    """KV-cache usage above which the batch limit does not grow."""
    low_utilization: float = 0.5
    """Below this utilization the batch limit grows straight to the predicted largest batch."""
    smoothing: float = 0.2
    """Weight of the newest step in the step-latency averages shown by /metrics."""

    def __post_init__(self) -> None:
        for name in (
            "max_prefill_tokens",
            "max_batch_size",
            "min_prefill_tokens",
            "initial_batch_size",
            "min_batch_size",
            "num_calibration_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.min_prefill_tokens > self.max_prefill_tokens:
            raise ValueError(
                f"min_prefill_tokens ({self.min_prefill_tokens}) must be <= "
                f"max_prefill_tokens ({self.max_prefill_tokens})"
            )
        if self.target_itl_s is not None and self.target_itl_s <= 0:
            raise ValueError(f"target_itl_s must be > 0, got {self.target_itl_s}")
        if self.target_ttft_s is not None and self.target_ttft_s <= 0:
            raise ValueError(f"target_ttft_s must be > 0, got {self.target_ttft_s}")
        if self.ttft_steps < 1 or self.max_stretch < 1:
            raise ValueError("ttft_steps and max_stretch must be >= 1")
        for name in ("dead_band", "prefill_share", "min_derived_target_s", "min_decode_spread"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.derive_factor < 1:
            raise ValueError(f"derive_factor must be >= 1, got {self.derive_factor}")
        for name in ("high_kv_usage", "low_utilization", "smoothing"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class StepSample:
    """One measured step, and the scheduler's state right after it."""

    num_decodes: int
    """Requests that computed their one next token in the step."""
    num_prefill_tokens: int
    """Prompt tokens computed in the step (new prompts, chunks, recomputes)."""
    latency_s: float
    """Wall time of the step, as a request's next token waits for it."""
    num_running: int
    """Requests holding KV blocks after the step."""
    num_waiting: int
    """Requests waiting to join after the step."""
    kv_usage: float
    """Fraction of the KV blocks in use after the step."""
    utilization: float = 0.0
    """Busy fraction of the device over the recent past (NVML, or the engine's busy time)."""
    prefill_attention: float | None = None
    """Thousands of (query, key) pairs the step's prompt chunks computed
    (`step_cost.attention_pairs`); None: its prompt tokens as one chunk from position 0."""


@dataclass(frozen=True)
class ControllerState:
    """What /metrics shows; every field is at its idle value while nothing runs."""

    prefill_budget: int
    """Prompt tokens the last planned step could take (the ceiling when idle)."""
    batch_limit: int
    """Most running requests before joins stop."""
    target_itl_s: float | None
    """The target in force; None with fixed budgets or before it is derived."""
    utilization: float
    """Utilization reported with the last step (0 when idle)."""
    decode_step_latency_s: float
    """Moving average of decode-only steps' latency (0 when idle)."""
    mixed_step_latency_s: float
    """Moving average of the latency of steps with prompt tokens (0 when idle)."""


class BatchController:
    """Chooses each step's prefill share and the batch limit; see the module docstring."""

    def __init__(
        self,
        config: ControllerConfig,
        cost: StepCostModel | None = None,
        startup: StartupSteps | None = None,
    ) -> None:
        """`cost` carries a learned fit over; `startup` seeds the fit with the shards'
        warmup measurement (and picks the reference batch of a derived target)."""
        self.config = config
        self.cost = cost or StepCostModel()
        self._seeded = startup is not None
        self._reference = 1
        if startup is not None:
            self.cost.seed(startup.samples())
            self._reference = startup.reference_batch(config.max_batch_size)
        self._target = config.target_itl_s if config.adaptive else None
        self._follows_fit = config.adaptive and config.target_itl_s is None
        self._logged_target: float | None = None
        self._limit = (
            self._bounded(config.initial_batch_size) if config.adaptive else config.max_batch_size
        )
        self._prefill_budget = config.max_prefill_tokens
        self._num_decode_samples = 0
        self._utilization = 0.0
        self._decode_latency = 0.0
        self._mixed_latency = 0.0
        self.num_limit_changes = 0
        """How often the batch limit changed (a steady load should rarely change it)."""
        self._first_tokens = FirstTokenDeadlines()
        self.clock_s = 0.0
        """The controller's clock: the sum of the observed steps' latencies (requests'
        ages are read on it; it stands still while nothing runs)."""
        if self._follows_fit:
            self._follow_fit()

    @property
    def target_itl_s(self) -> float | None:
        """The inter-token latency target in force (None: fixed budgets, or not derived yet);
        a derived one moves with the fit."""
        return self._target

    @property
    def target_ttft_s(self) -> float | None:
        """The time-to-first-token target in force: explicit, or `ttft_steps` inter-token
        targets (None while there is no inter-token target)."""
        if not self.config.adaptive:
            return None
        if self.config.target_ttft_s is not None:
            return self.config.target_ttft_s
        return None if self._target is None else self.config.ttft_steps * self._target

    @property
    def batch_limit(self) -> int:
        """Most running requests; waiting ones join only below it."""
        return self._limit

    def prefill_budget(
        self, num_decodes: int, context: int = 0, backlog: Backlog | None = None
    ) -> int:
        """Prompt tokens a step with `num_decodes` decodes may compute beside them, as a
        chunk starting at position `context` of its prompt; more when the `backlog` would
        otherwise miss the TTFT target."""
        config = self.config
        if self._target is None or not self.cost.is_ready or num_decodes == 0:
            return config.max_prefill_tokens
        ceiling = config.max_prefill_tokens
        fit = self.cost.prefill_tokens_within(self._target, num_decodes, ceiling, context)
        share = max(self._least_share(context), _round_down(fit))
        if backlog is None or self.target_ttft_s is None:
            return share
        stretched = self._target * config.max_stretch
        room = self.cost.prefill_tokens_within(stretched, num_decodes, ceiling, context)
        catch_up = self._first_tokens.catch_up(
            self.cost, self.target_ttft_s, backlog, num_decodes, context, share, room
        )
        return max(share, catch_up)

    def _least_share(self, context: int) -> int:
        """The floor of the prefill share for a chunk at `context`: the prompt tokens that
        cost what `min_prefill_tokens` cost from position 0, at least one. Deep in a long
        prompt each token attends over thousands of keys: 32 tokens at position 2,500 cost
        as much as 170 at 0 (2-core Zen 5, bfloat16), and a floor in tokens held the
        streams beside them to 4-6x their decode step, whatever the target."""
        least = self.config.min_prefill_tokens
        cost = self.cost.prompt_cost(least) + 1e-9  # a nanosecond of slack for rounding
        return max(1, self.cost.prompt_tokens_within(cost, least, context))

    def step_of_its_own(self) -> int:
        """Prompt tokens a step without decodes may take within the inter-token target (the
        delay it adds to the decodes it runs before); 0 with fixed budgets or before there is
        a target."""
        if self._target is None or not self.cost.is_ready:
            return 0
        ceiling = self.config.max_prefill_tokens
        return self.cost.prefill_tokens_within(self._target, 0, ceiling)

    def plan_prefill(
        self, num_decodes: int, context: int = 0, backlog: Backlog | None = None
    ) -> int:
        """`prefill_budget` for the step being planned; remembered for /metrics."""
        budget = self.prefill_budget(num_decodes, context, backlog)
        if budget != self._prefill_budget:
            log.debug(
                "prefill budget %d -> %d tokens beside %d decodes (predicted decode step "
                "%.1f ms, target %s; fit %s)",
                self._prefill_budget,
                budget,
                num_decodes,
                self.cost.predict(num_decodes) * 1e3,
                _ms(self._target),
                self.cost.describe(),
            )
            self._prefill_budget = budget
        return budget

    def observe(self, sample: StepSample) -> None:
        """Learn from one measured step, then move the batch limit if the step calls for it."""
        self._utilization = sample.utilization
        self.clock_s += sample.latency_s
        self._record_latency(sample)
        self.cost.add(
            sample.num_decodes,
            sample.num_prefill_tokens,
            sample.latency_s,
            sample.prefill_attention,
        )
        if not self.config.adaptive:
            return
        if sample.num_decodes > 0:
            self._num_decode_samples += 1
        if self._follows_fit:
            self._follow_fit()
        self._set_limit(self._bounded(self._next_limit(sample)), sample)

    def on_idle(self) -> None:
        """Nothing runs or waits: measured signals drop to their idle values. The cost fit,
        the target and the batch limit are kept: they describe the machine, not the load."""
        self._utilization = 0.0
        self._decode_latency = 0.0
        self._mixed_latency = 0.0
        self._prefill_budget = self.config.max_prefill_tokens

    def state(self) -> ControllerState:
        """The controller's current choices and measurements, for /metrics."""
        return ControllerState(
            prefill_budget=self._prefill_budget,
            batch_limit=self._limit,
            target_itl_s=self._target,
            utilization=self._utilization,
            decode_step_latency_s=self._decode_latency,
            mixed_step_latency_s=self._mixed_latency,
        )

    # ---- internals ----

    def _record_latency(self, sample: StepSample) -> None:
        alpha = self.config.smoothing
        if sample.num_prefill_tokens > 0:
            previous = self._mixed_latency or sample.latency_s
            self._mixed_latency = previous + alpha * (sample.latency_s - previous)
        elif sample.num_decodes > 0:
            previous = self._decode_latency or sample.latency_s
            self._decode_latency = previous + alpha * (sample.latency_s - previous)

    def _follow_fit(self) -> None:
        """Derive the target from the fit again (after calibration when unseeded)."""
        config = self.config
        calibrating = (
            self._target is None
            and not self._seeded
            and self._num_decode_samples < config.num_calibration_steps
        )
        if calibrating or not self.cost.is_ready:
            return
        spread_needed = config.min_decode_spread * self._reference
        if self._target is not None and self.cost.decode_spread() < spread_needed:
            return
        batch_one, reference = self.cost.predict(1), self.cost.predict(self._reference)
        self._target = derived_target(
            batch_one,
            reference,
            factor=config.derive_factor,
            prefill_share=config.prefill_share,
            floor=config.min_derived_target_s,
        )
        logged = self._logged_target
        if logged is None or abs(self._target - logged) >= TARGET_LOG_CHANGE * logged:
            self._logged_target = self._target
            log.info(
                "Inter-token latency target %.1f ms, from the fitted decode step: %.1f ms at "
                "batch 1, %.1f ms at batch %d (%d served steps%s)",
                self._target * 1e3,
                batch_one * 1e3,
                reference * 1e3,
                self._reference,
                self.cost.num_samples,
                " over the startup measurement" if self._seeded else "",
            )

    def _bounded(self, limit: int) -> int:
        """`limit` within [min_batch_size, max_batch_size]."""
        config = self.config
        return min(config.max_batch_size, max(config.min_batch_size, limit))

    def _wants_more(self, sample: StepSample) -> bool:
        """Requests wait, and the batch limit (not blocks) is what keeps them waiting."""
        return (
            sample.num_waiting > 0
            and sample.num_running >= self._limit
            and sample.kv_usage < self.config.high_kv_usage
        )

    def _next_limit(self, sample: StepSample) -> int:
        config, limit = self.config, self._limit
        if self._target is None:  # calibrating: small batches first, doubling on demand
            return min(config.max_batch_size, 2 * limit) if self._wants_more(sample) else limit
        if not self.cost.is_ready:
            largest = config.max_batch_size
        else:
            largest = max(
                1,
                self.cost.largest_batch(
                    self._target, config.min_prefill_tokens, config.max_batch_size
                ),
            )
            over = self._target * (1 + config.dead_band)
            if self.cost.predict(limit, config.min_prefill_tokens) > over and self._near_limit(
                sample, over
            ):
                # At most halve per step: one noisy fit must not collapse the batch.
                return min(limit, max(largest, limit // 2))
        if self._wants_more(sample) and largest > limit:
            if sample.utilization < config.low_utilization:
                return largest
            return min(largest, 2 * limit)
        return limit

    def _near_limit(self, sample: StepSample, over: float) -> bool:
        """Whether `sample` is evidence that the limit's batch breaks the target: a step of at
        least half the limit's decodes that took longer than `over` with no more prompt
        tokens than the smallest share (its measured latency less the fitted cost of the
        prompt tokens past that share: the prediction it confirms is of a step with that
        share). A prediction alone is not evidence: between rounds of a load (one request
        left, a burst arriving) the fit extrapolates from a few slow steps (the machine busy
        with the burst's arrival) to a batch it is not running, and halving the limit then
        held a burst of 32 behind a limit of 16 for 20 steps (c=32 TTFT p99 1.8 s against
        0.35 s, Zen 5). Nor is a step the prompts waiting stretched: at c=64 the steps
        that caught up with a queue past its TTFT target ran over the inter-token target by
        design, and shrinking the limit for them held more of the queue back (TTFT p50 1.6x
        fixed budgets', goodput 0.87x, Zen 5)."""
        if 2 * sample.num_decodes < self._limit:
            return False
        extra = self.cost.prompt_cost(
            sample.num_prefill_tokens, sample.prefill_attention
        ) - self.cost.prompt_cost(self.config.min_prefill_tokens)
        return sample.latency_s - max(0.0, extra) > over

    def _set_limit(self, limit: int, sample: StepSample) -> None:
        if limit == self._limit:
            return
        log.debug(
            "batch limit %d -> %d (predicted step %.1f ms at %d decodes + %d prompt tokens, "
            "target %s, %d running, %d waiting, utilization %.2f, KV usage %.2f)",
            self._limit,
            limit,
            self.cost.predict(limit, self.config.min_prefill_tokens) * 1e3,
            limit,
            self.config.min_prefill_tokens,
            _ms(self._target),
            sample.num_running,
            sample.num_waiting,
            sample.utilization,
            sample.kv_usage,
        )
        self._limit = limit
        self.num_limit_changes += 1


def _round_down(tokens: int) -> int:
    """`tokens` to 3 significant bits (at most an eighth less): small moves of the fit do
    not change the prefill share every step."""
    if tokens < 8:
        return tokens
    grid = 1 << (tokens.bit_length() - 4)
    return tokens - tokens % grid


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1e3:.1f} ms"
