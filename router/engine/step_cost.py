"""What a step costs: an online least-squares fit of step latency to the step's tokens.

    latency ≈ overhead + per_decode · num_decodes + per_prefill · num_prefill_tokens

The batch controller asks it two questions before every step: how long would a step of
n decodes take, and how many prompt tokens fit beside them under a latency target.
Pure Python, a few float operations per step.
"""

from __future__ import annotations

import math

NUM_COEFFICIENTS = 3
"""overhead (s), per decode (s), per prefill token (s)."""


class StepCostModel:
    """Exponentially weighted least squares over the measured steps, refit every step.

    Recent steps weigh most (`forgetting` per step), so the fit follows a machine that
    gets slower or faster. A light ridge pulls each coefficient toward its previous value:
    while the recent steps cannot tell two coefficients apart (a steady batch, no prompts)
    they keep what earlier steps taught instead of wandering with the noise. The
    coefficients never go negative (a step never gets cheaper with more tokens).
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
        self.num_samples = 0

    @property
    def is_ready(self) -> bool:
        """Whether enough steps were measured for the predictions to mean something."""
        return self.num_samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(overhead, per decode, per prefill token), in seconds."""
        return self._coefficients

    def add(self, num_decodes: int, num_prefill_tokens: int, latency_s: float) -> None:
        """Record one measured step and refit."""
        if num_decodes < 0 or num_prefill_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if not math.isfinite(latency_s) or latency_s < 0:
            raise ValueError(f"latency must be a finite number >= 0, got {latency_s}")
        x = (1.0, float(num_decodes), float(num_prefill_tokens))
        for i in range(NUM_COEFFICIENTS):
            self._moment[i] = self.forgetting * self._moment[i] + x[i] * latency_s
            for j in range(NUM_COEFFICIENTS):
                self._gram[i][j] = self.forgetting * self._gram[i][j] + x[i] * x[j]
        self.num_samples += 1
        self._refit()

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

    def _refit(self) -> None:
        """Solve (G + R) θ = m + R θ_prev, then clamp θ at 0."""
        matrix = [row[:] for row in self._gram]
        rhs = self._moment[:]
        for i in range(NUM_COEFFICIENTS):
            matrix[i][i] += self._ridge[i]
            rhs[i] += self._ridge[i] * self._coefficients[i]
        solution = _solve(matrix, rhs)
        overhead, per_decode, per_prefill = (max(0.0, value) for value in solution)
        self._coefficients = (overhead, per_decode, per_prefill)


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
