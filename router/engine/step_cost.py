"""What a step costs: an online least-squares fit of step latency to the step's tokens.

    latency ≈ overhead + per_decode · num_decodes + per_prefill · num_prefill_tokens
              + per_attention · prefill_attention

`prefill_attention` is the attention a step's prompt chunks compute, in thousands of
(query, key) pairs (`attention_pairs`): a chunk of n tokens starting at position p
attends over p + 1 ... p + n keys. It is what makes the late chunks of a long prompt cost
more than its first ones (measured on a 2-core CPU: 8 decodes plus an 80-token chunk of a
2,900-token prompt took 2.7x a decode step at position 160 and 8.5x at position 2,720),
so the prefill share of a step shrinks as its chunk moves down a long prompt.

The batch controller asks it two questions before every step: how long would a step of
n decodes take, and how many prompt tokens fit beside them under a latency target. It may
start from the steps the shards timed at startup (`seed`), a prior that served steps
outweigh at once. Pure Python, a few float operations per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

NUM_COEFFICIENTS = 4
"""overhead (s), per decode (s), per prefill token (s), per thousand attention pairs (s)."""
OUTLIER_FACTOR = 3.0
"""A served step within the token counts the fit has seen, measured at more than this many
times its prediction, counts as this many. What made it that slow is not in its token
counts (the router's event loop busy with a burst of arrivals, a collection, another
process): one such step of the ~20 the fit weighs once bent it to predict 1 s for a
17-decode step (c=64 on a 2-core CPU, the batch limit halved). A machine that really
slows down still moves the fit, each of its steps counting up to 3x the prediction before
it; a step past what the fit has seen (more decodes, a longer chunk) counts in full, for
there the prediction is a guess."""
PAIRS_UNIT = 1000.0
"""Attention pairs are counted in thousands: a typical chunk's count is then of the order
of its tokens, and the ridge (in tokens²) means as much for its coefficient."""


def attention_pairs(start: int, num_tokens: int) -> float:
    """Thousands of (query, key) pairs a chunk of `num_tokens` prompt tokens starting at
    position `start` computes: query p + i attends over p + i + 1 keys."""
    return num_tokens * (start + (num_tokens + 1) / 2) / PAIRS_UNIT


class StepCostModel:
    """Exponentially weighted least squares over the measured steps, refit every step.

    Recent steps weigh most (`forgetting` per step), so the fit follows a machine that
    gets slower or faster. A light ridge pulls each coefficient toward its previous value:
    while the recent steps cannot tell two coefficients apart (a steady batch, no prompts)
    they keep what earlier steps taught instead of wandering with the noise. The
    coefficients never go negative (a step never gets cheaper with more tokens): the fit
    is solved under that constraint, not clamped after it. A step slowed by what its token
    counts do not hold counts at most `OUTLIER_FACTOR` times its prediction.
    """

    def __init__(self, forgetting: float = 0.95, ridge: float = 5.0, min_samples: int = 8) -> None:
        """`ridge` is in tokens²: a slope needs about that much spread in its token count
        among the recent steps before the data outweigh its previous value."""
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if ridge <= 0:
            raise ValueError(f"ridge must be > 0, got {ridge}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be at least 1, got {min_samples}")
        self.forgetting = forgetting
        self.min_samples = min_samples
        # The intercept's ridge is tiny: it is always well determined by the mean latency.
        self._ridge = (ridge * 1e-3, ridge, ridge, ridge)
        self._gram = [[0.0] * NUM_COEFFICIENTS for _ in range(NUM_COEFFICIENTS)]
        self._moment = [0.0] * NUM_COEFFICIENTS
        self._coefficients: tuple[float, ...] = (0.0,) * NUM_COEFFICIENTS
        self._seeded = False
        self._seen = [0.0] * NUM_COEFFICIENTS
        """The largest value of each regressor among the steps fitted (the seed's too)."""
        self.num_samples = 0
        """Served steps measured (the seed's steps not counted)."""

    @property
    def is_ready(self) -> bool:
        """Whether the predictions mean something: seeded, or enough steps measured."""
        return self._seeded or self.num_samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(overhead, per decode, per prefill token, per thousand attention pairs), in s."""
        return self._coefficients

    def seed(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """Start the fit at the coefficients of prior steps, (num_decodes,
        num_prefill_tokens, latency_s) each: the shards' startup measurement. Predictions
        are then ready at once.

        The prior weighs what the coefficients earlier steps taught weigh (the light
        ridge), not what measured steps weigh: each served step outweighs it wherever its
        token counts vary, and it holds only where served steps cannot tell coefficients
        apart. A prior timed on a busy machine (every step 2-3x too slow) is so corrected
        within about ten served steps of varying batch. Prior steps as pseudo-samples instead would not do: a
        timed 256-token prefill chunk outweighs dozens of served steps of a few prompt
        tokens in the per-token cost.
        """
        gram = [[0.0] * NUM_COEFFICIENTS for _ in range(NUM_COEFFICIENTS)]
        moment = [0.0] * NUM_COEFFICIENTS
        for num_decodes, num_prefill_tokens, latency_s in steps:
            # A timed prefill chunk starts at position 0.
            attention = attention_pairs(0, num_prefill_tokens)
            features = _features(num_decodes, num_prefill_tokens, attention, latency_s)
            _accumulate(gram, moment, features)
            self._see(features[0])
            self._seeded = True
        if self._seeded:
            self._coefficients = self._fit(gram, moment)

    def add(
        self,
        num_decodes: int,
        num_prefill_tokens: int,
        latency_s: float,
        prefill_attention: float | None = None,
    ) -> None:
        """Record one measured step and refit. `prefill_attention` (`attention_pairs` of
        its chunks) defaults to its prompt tokens as one chunk from position 0. Once the
        fit is ready, a step within the token counts it has seen counts at most
        `OUTLIER_FACTOR` times its prediction."""
        if prefill_attention is None:
            prefill_attention = attention_pairs(0, num_prefill_tokens)
        features = _features(num_decodes, num_prefill_tokens, prefill_attention, latency_s)
        x, _ = features
        if self.is_ready and all(v <= seen for v, seen in zip(x, self._seen, strict=True)):
            predicted = self._predict(x)
            if predicted > 0:
                features = (x, min(latency_s, OUTLIER_FACTOR * predicted))
        self._see(x)
        for i in range(NUM_COEFFICIENTS):
            self._moment[i] *= self.forgetting
            for j in range(NUM_COEFFICIENTS):
                self._gram[i][j] *= self.forgetting
        _accumulate(self._gram, self._moment, features)
        self.num_samples += 1
        self._coefficients = self._fit(self._gram, self._moment)

    def describe(self) -> str:
        """The coefficients, for log lines: overhead, per decode, per prompt token (ms), per
        thousand attention pairs (ms)."""
        overhead, decode, prefill, attention = (c * 1e3 for c in self._coefficients)
        return (
            f"{overhead:.2f} ms + {decode:.3f} ms/decode + {prefill:.3f} ms/prompt token"
            f" + {attention:.3f} ms/k attention pairs"
        )

    def decode_spread(self) -> float:
        """The spread (weighted standard deviation) of the decode counts among the served
        steps the fit weighs: how well they tell the per-decode cost from the overhead (0
        while every recent step ran one batch size, or none was served)."""
        weight, total, squares = self._gram[0][0], self._gram[0][1], self._gram[1][1]
        if weight <= 0:
            return 0.0
        mean = total / weight
        return math.sqrt(max(0.0, squares / weight - mean * mean))

    def _see(self, regressors: tuple[float, ...]) -> None:
        self._seen = [max(seen, v) for seen, v in zip(self._seen, regressors, strict=True)]

    def predict(self, num_decodes: int, num_prefill_tokens: int = 0, context: int = 0) -> float:
        """Predicted latency (s) of a step with these token counts, its prompt tokens one
        chunk that starts at position `context`."""
        attention = attention_pairs(context, num_prefill_tokens)
        return self._predict((1.0, num_decodes, num_prefill_tokens, attention))

    def prompt_cost(self, num_prefill_tokens: int, prefill_attention: float | None = None) -> float:
        """Predicted latency (s) the prompt tokens of a step add to it (`prefill_attention`
        as in `add`)."""
        if prefill_attention is None:
            prefill_attention = attention_pairs(0, num_prefill_tokens)
        return self._predict((0.0, 0.0, float(num_prefill_tokens), prefill_attention))

    def _predict(self, regressors: tuple[float, ...]) -> float:
        """Predicted latency (s) of a step whose regressors (`_features`) are these."""
        return sum(c * v for c, v in zip(self._coefficients, regressors, strict=True))

    def largest_batch(self, target_s: float, num_prefill_tokens: int, limit: int) -> int:
        """The most decodes (at most `limit`) whose step with `num_prefill_tokens` beside
        them is predicted to take at most `target_s`; 0 when not even one fits."""
        per_decode = self._coefficients[1]
        room = target_s - self.predict(0, num_prefill_tokens)
        if room < 0:
            return 0
        if per_decode <= 0:
            return limit
        return min(limit, math.floor(room / per_decode))

    def prefill_tokens_within(
        self, target_s: float, num_decodes: int, limit: int, context: int = 0
    ) -> int:
        """The most prompt tokens (at most `limit`) a step with `num_decodes` decodes may
        add, as a chunk starting at position `context`, and still be predicted to take at
        most `target_s`; 0 when none fit."""
        return self.prompt_tokens_within(target_s - self.predict(num_decodes), limit, context)

    def prompt_tokens_within(self, seconds: float, limit: int, context: int = 0) -> int:
        """The most prompt tokens (at most `limit`) whose `prompt_cost`, as a chunk starting
        at position `context`, is at most `seconds`; 0 when none fit."""
        per_prefill, per_attention = self._coefficients[2:]
        if seconds <= 0:
            return 0
        # n tokens cost a·n² + b·n (attention_pairs is quadratic in n): the largest n within.
        a = per_attention / (2 * PAIRS_UNIT)
        b = per_prefill + per_attention * (context + 0.5) / PAIRS_UNIT
        if a <= 0:
            return limit if b <= 0 else min(limit, math.floor(seconds / b))
        return min(limit, math.floor((math.sqrt(b * b + 4 * a * seconds) - b) / (2 * a)))

    def _fit(self, gram: list[list[float]], moment: list[float]) -> tuple[float, ...]:
        """argmin over θ >= 0 of θᵀ(G + R)θ - 2θᵀ(m + R θ_prev): the weighted least squares
        with the ridge toward the previous coefficients, none negative."""
        matrix = [row[:] for row in gram]
        rhs = moment[:]
        for i in range(NUM_COEFFICIENTS):
            matrix[i][i] += self._ridge[i]
            rhs[i] += self._ridge[i] * self._coefficients[i]
        return _nonnegative_solve(matrix, rhs)


def _features(
    num_decodes: int, num_prefill_tokens: int, prefill_attention: float, latency_s: float
) -> tuple[tuple[float, ...], float]:
    """One step as (regressors, latency), checked."""
    if num_decodes < 0 or num_prefill_tokens < 0 or prefill_attention < 0:
        raise ValueError("token counts must be >= 0")
    if not math.isfinite(latency_s) or latency_s < 0:
        raise ValueError(f"latency must be a finite number >= 0, got {latency_s}")
    regressors = (1.0, float(num_decodes), float(num_prefill_tokens), float(prefill_attention))
    return regressors, latency_s


def _accumulate(
    gram: list[list[float]], moment: list[float], features: tuple[tuple[float, ...], float]
) -> None:
    """Add one step's x xᵀ to `gram` and x · latency to `moment`."""
    x, latency_s = features
    for i in range(NUM_COEFFICIENTS):
        moment[i] += x[i] * latency_s
        for j in range(NUM_COEFFICIENTS):
            gram[i][j] += x[i] * x[j]


def _nonnegative_solve(matrix: list[list[float]], rhs: list[float]) -> tuple[float, ...]:
    """The θ >= 0 minimising θᵀAθ - 2θᵀb (A positive definite): among the solutions with some
    coefficients held at 0 and the rest solved, the feasible one of least cost. Clamping
    the unconstrained solution instead is no fit at all: an intercept solved at -40 ms and
    clamped to 0 put every prediction 40 ms over the steps it was fitted to."""
    best, best_cost = (0.0,) * NUM_COEFFICIENTS, 0.0
    for free in _SUBSETS:
        sub = _solve([[matrix[i][j] for j in free] for i in free], [rhs[i] for i in free])
        if min(sub) < 0:
            continue
        if len(free) == NUM_COEFFICIENTS:  # the common case: nothing is held at 0
            return tuple(sub)
        theta = [0.0] * NUM_COEFFICIENTS
        for i, value in zip(free, sub, strict=True):
            theta[i] = value
        cost = sum(
            theta[i] * (sum(matrix[i][j] * theta[j] for j in free) - 2 * rhs[i]) for i in free
        )
        if cost < best_cost:
            best, best_cost = tuple(theta), cost
    return best


_SUBSETS = [
    free
    for size in range(NUM_COEFFICIENTS, 0, -1)
    for free in itertools.combinations(range(NUM_COEFFICIENTS), size)
]
"""Which coefficients are solved (the others held at 0), all of them first."""


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; the ridge keeps `matrix` nonsingular."""
    n = len(rhs)
    for col in range(n):
        pivot = max(range(col, n), key=lambda row: abs(matrix[row][col]))
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for row in range(col + 1, n):
            factor = matrix[row][col] / matrix[col][col]
            for k in range(col, n):
                matrix[row][k] -= factor * matrix[col][k]
            rhs[row] -= factor * rhs[col]
    solution = [0.0] * n
    for row in reversed(range(n)):
        tail = sum(matrix[row][k] * solution[k] for k in range(row + 1, n))
        solution[row] = (rhs[row] - tail) / matrix[row][row]
    return solution
