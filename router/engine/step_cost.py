"""What a step costs: an online least-squares fit of step latency to the step's tokens.

    latency ≈ overhead + per_decode · num_decodes + per_prefill · num_prefill_tokens

The batch controller asks it two questions before every step: how long would a step of
n decodes take, and how many prompt tokens fit beside them under a latency target. It may
start from the steps the shards timed at startup (`seed`), a prior that served steps
outweigh at once. Pure Python, a few float operations per step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

NUM_COEFFICIENTS = 3
"""overhead (s), per decode (s), per prefill token (s)."""


class StepCostModel:
    """Exponentially weighted least squares over the measured steps, refit every step.

    Recent steps weigh most (`forgetting` per step), so the fit follows a machine that
    gets slower or faster. A light ridge pulls each coefficient toward its previous value:
    while the recent steps cannot tell two coefficients apart (a steady batch, no prompts)
    they keep what earlier steps taught instead of wandering with the noise. The
    coefficients never go negative (a step never gets cheaper with more tokens): the fit
    is solved under that constraint, not clamped after it.
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
        self._ridge = (ridge * 1e-3, ridge, ridge)
        self._gram = [[0.0] * NUM_COEFFICIENTS for _ in range(NUM_COEFFICIENTS)]
        self._moment = [0.0] * NUM_COEFFICIENTS
        self._coefficients = (0.0, 0.0, 0.0)
        self._seeded = False
        self.num_samples = 0
        """Served steps measured (the seed's steps not counted)."""

    @property
    def is_ready(self) -> bool:
        """Whether the predictions mean something: seeded, or enough steps measured."""
        return self._seeded or self.num_samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(overhead, per decode, per prefill token), in seconds."""
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
            _accumulate(gram, moment, _features(num_decodes, num_prefill_tokens, latency_s))
            self._seeded = True
        if self._seeded:
            self._coefficients = self._fit(gram, moment)

    def add(self, num_decodes: int, num_prefill_tokens: int, latency_s: float) -> None:
        """Record one measured step and refit."""
        features = _features(num_decodes, num_prefill_tokens, latency_s)
        for i in range(NUM_COEFFICIENTS):
            self._moment[i] *= self.forgetting
            for j in range(NUM_COEFFICIENTS):
                self._gram[i][j] *= self.forgetting
        _accumulate(self._gram, self._moment, features)
        self.num_samples += 1
        self._coefficients = self._fit(self._gram, self._moment)

    def predict(self, num_decodes: int, num_prefill_tokens: int = 0) -> float:
        """Predicted latency (s) of a step with these token counts."""
        overhead, per_decode, per_prefill = self._coefficients
        return overhead + per_decode * num_decodes + per_prefill * num_prefill_tokens

    def largest_batch(self, target_s: float, num_prefill_tokens: int, limit: int) -> int:
        """The most decodes (at most `limit`) whose step with `num_prefill_tokens` beside
        them is predicted to take at most `target_s`; 0 when not even one fits."""
        overhead, per_decode, per_prefill = self._coefficients
        room = target_s - overhead - per_prefill * num_prefill_tokens
        if room < 0:
            return 0
        if per_decode <= 0:
            return limit
        return min(limit, math.floor(room / per_decode))

    def prefill_tokens_within(self, target_s: float, num_decodes: int, limit: int) -> int:
        """The most prompt tokens (at most `limit`) a step with `num_decodes` decodes may
        add and still be predicted to take at most `target_s`; 0 when none fit."""
        per_prefill = self._coefficients[2]
        room = target_s - self.predict(num_decodes)
        if room <= 0:
            return 0
        if per_prefill <= 0:
            return limit
        return min(limit, math.floor(room / per_prefill))

    def _fit(self, gram: list[list[float]], moment: list[float]) -> tuple[float, float, float]:
        """argmin over θ >= 0 of θᵀ(G + R)θ - 2θᵀ(m + R θ_prev): the weighted least squares
        with the ridge toward the previous coefficients, none negative."""
        matrix = [row[:] for row in gram]
        rhs = moment[:]
        for i in range(NUM_COEFFICIENTS):
            matrix[i][i] += self._ridge[i]
            rhs[i] += self._ridge[i] * self._coefficients[i]
        return _nonnegative_solve(matrix, rhs)


def _features(
    num_decodes: int, num_prefill_tokens: int, latency_s: float
) -> tuple[tuple[float, ...], float]:
    """One step as (regressors, latency), checked."""
    if num_decodes < 0 or num_prefill_tokens < 0:
        raise ValueError("token counts must be >= 0")
    if not math.isfinite(latency_s) or latency_s < 0:
        raise ValueError(f"latency must be a finite number >= 0, got {latency_s}")
    return (1.0, float(num_decodes), float(num_prefill_tokens)), latency_s


def _accumulate(
    gram: list[list[float]], moment: list[float], features: tuple[tuple[float, ...], float]
) -> None:
    """Add one step's x xᵀ to `gram` and x · latency to `moment`."""
    x, latency_s = features
    for i in range(NUM_COEFFICIENTS):
        moment[i] += x[i] * latency_s
        for j in range(NUM_COEFFICIENTS):
            gram[i][j] += x[i] * x[j]


def _nonnegative_solve(matrix: list[list[float]], rhs: list[float]) -> tuple[float, float, float]:
    """The θ >= 0 minimising θᵀAθ - 2θᵀb (A positive definite): among the solutions with some
    coefficients held at 0 and the rest solved, the feasible one of least cost. Clamping
    the unconstrained solution instead is no fit at all: an intercept solved at -40 ms and
    clamped to 0 put every prediction 40 ms over the steps it was fitted to."""
    best, best_cost = (0.0, 0.0, 0.0), 0.0
    for free in _SUBSETS:
        sub = _solve([[matrix[i][j] for j in free] for i in free], [rhs[i] for i in free])
        if min(sub) < 0:
            continue
        if len(free) == NUM_COEFFICIENTS:  # the common case: nothing is held at 0
            return sub[0], sub[1], sub[2]
        theta = [0.0] * NUM_COEFFICIENTS
        for i, value in zip(free, sub, strict=True):
            theta[i] = value
        cost = sum(
            theta[i] * (sum(matrix[i][j] * theta[j] for j in free) - 2 * rhs[i]) for i in free
        )
        if cost < best_cost:
            best, best_cost = (theta[0], theta[1], theta[2]), cost
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
