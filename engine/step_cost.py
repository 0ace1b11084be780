"""How long a step takes for how many tokens: a line fitted to the steps this engine ran.

    seconds = fixed + per_token x tokens

fitted by exponentially weighted least squares over the recent steps (each step's weight
decays by DECAY per step after it), so that it follows the machine as it warms up, as
threads are taken by other work, and as the batch's context grows. The scheduler asks it two
things (engine/scheduler.py, while a tenant below its share is present): how long that
tenant's first step would take (`predict`: the fixed part holds what the running batch's
decode rows cost), and how many prompt tokens of another tenant add at most a given time to
a step (`marginal_tokens`).

A line, not a model of attention's quadratic term or of the decode rows' KV reads: it is
asked about steps like the ones it saw (the same machine, similar batches), and errs within
one step's noise. Until MIN_STEPS steps have been measured, or while every step measured had
the same size (no slope to see), `fitted` is False and the scheduler caps nothing by time.
"""

from __future__ import annotations

DECAY = 0.97  # per step: the fit's memory is about 1 / (1 - DECAY) = 33 steps
MIN_STEPS = 8


class StepCost:
    def __init__(self, *, fixed: float | None = None, per_token: float | None = None) -> None:
        """`fixed` and `per_token` (seconds) pin the line instead of fitting it (tests)."""
        self._pinned = fixed is not None and per_token is not None
        self._fixed = fixed or 0.0
        self._per_token = per_token or 0.0
        # Decayed sums of 1, x, y, x^2 and xy over the observed (tokens, seconds).
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.num_steps = 0

    @property
    def fitted(self) -> bool:
        return self._pinned or (self.num_steps >= MIN_STEPS and self._per_token > 0.0)

    @property
    def fixed(self) -> float:
        return self._fixed

    @property
    def per_token(self) -> float:
        return self._per_token

    def observe(self, num_tokens: int, seconds: float) -> None:
        if self._pinned or num_tokens < 1 or seconds <= 0.0:
            return
        x, y = float(num_tokens), seconds
        self._n = self._n * DECAY + 1.0
        self._sx = self._sx * DECAY + x
        self._sy = self._sy * DECAY + y
        self._sxx = self._sxx * DECAY + x * x
        self._sxy = self._sxy * DECAY + x * y
        self.num_steps += 1
        self._refit()

    def predict(self, num_tokens: int) -> float:
        """Seconds for a step of `num_tokens` tokens."""
        return self._fixed + self._per_token * num_tokens

    def marginal_tokens(self, seconds: float) -> int:
        """How many tokens add `seconds` to a step (its fixed cost already paid)."""
        if self._per_token <= 0.0:
            return 0
        return int(seconds / self._per_token + 1e-6)  # 8.5 ms / 0.5 ms is 17, not 16.99

    def _refit(self) -> None:
        n = self._n
        mean_x, mean_y = self._sx / n, self._sy / n
        var_x = self._sxx / n - mean_x * mean_x
        # Steps of one size show no slope: wait for a step of another size (the first
        # prefill after decodes, a chunk) rather than guess one.
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            return
        slope = (self._sxy / n - mean_x * mean_y) / var_x
        if slope <= 0.0:  # noise larger than the signal: keep the last line
            return
        self._per_token = slope
        self._fixed = max(0.0, mean_y - slope * mean_x)
