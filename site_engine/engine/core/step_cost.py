"""What a step costs in seconds, learned from the steps the engine ran: the time side of the
deferral bound (step_budget.py).

A step's time is modelled as `base + per_token * tokens + per_context * context`, where
`tokens` are the positions it computes and `context` the positions its attention reads (each
row's KV length after the step). That is the roofline of a transformer step in three numbers:
the weights read once whatever the batch (base), the matmul work per token (dominant in
prefill), and the KV reads per row (what makes a decode row of a long conversation dearer than
one of a short). The token bound alone was blind to the hardware: 512 background prefill
tokens are a few percent of a CPU-sized model's step but most of a 12 ms Llama-3-8B decode step
on an H100, where they lengthened the interactive rows' steps by ~80% (bench/results/priority/
priority_h100.md: TPOT p99 1.8x).

The fit is least squares with exponential forgetting (recursive sums of x x^T and x y, each
observation weighing `decay` times the one after it), so that a model that warms up, a changing
mix or another clock (a bench's token clock) are followed within a few hundred steps, and with
a small ridge term so that steps that all look alike (decode-only, where tokens and context rise
together) give a stable answer inside the span of what was seen instead of wild coefficients.
The coefficients are clamped at zero: a step never gets cheaper with more work. Pure Python, a
few microseconds a step; no clock of its own (the engine's owner measures and reports).
"""

from __future__ import annotations

from dataclasses import dataclass

_FEATURES = 3
DEFAULT_DECAY = 0.995  # an effective memory of ~200 steps
DEFAULT_MIN_SAMPLES = 32
_RIDGE = 1e-6  # relative to the diagonal: only breaks ties between collinear features
_REFIT_EVERY = 8


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds a step takes: base + per_token * tokens + per_context * context."""

    base_s: float
    per_token_s: float
    per_context_s: float

    def seconds(self, tokens: int, context: int) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_context_s * context

    def extra_seconds(self, tokens: int, context: int) -> float:
        """What adding these rows to a step adds to its time (no base: the step runs anyway)."""
        return self.per_token_s * tokens + self.per_context_s * context


class StepCostModel:
    """Learns StepCost from (tokens, context, seconds) observations. `current` is None until
    `min_samples` steps were seen: the deferral bound is then the token bound alone."""

    def __init__(self, decay: float = DEFAULT_DECAY, min_samples: int = DEFAULT_MIN_SAMPLES):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if min_samples < _FEATURES:
            raise ValueError(f"min_samples must be >= {_FEATURES}, got {min_samples}")
        self._decay = decay
        self._min_samples = min_samples
        self._xx = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self._xy = [0.0] * _FEATURES
        self._samples = 0
        self._since_fit = 0
        self._current: StepCost | None = None

    @property
    def samples(self) -> int:
        return self._samples

    @property
    def current(self) -> StepCost | None:
        return self._current

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A step of `tokens` computed positions reading `context` KV positions took
        `seconds`. Steps of no work or of a non-positive time say nothing and are ignored."""
        if tokens <= 0 or not seconds > 0.0:
            return
        x = (1.0, float(tokens), float(context))
        decay = self._decay
        xx, xy = self._xx, self._xy
        for i in range(_FEATURES):
            xi = x[i]
            xy[i] = xy[i] * decay + xi * seconds
            row = xx[i]
            for j in range(_FEATURES):
                row[j] = row[j] * decay + xi * x[j]
        self._samples += 1
        self._since_fit += 1
        if self._samples >= self._min_samples and (
            self._current is None or self._since_fit >= _REFIT_EVERY
        ):
            self._current = self._fit() or self._current
            self._since_fit = 0

    def _fit(self) -> StepCost | None:
        a = [row[:] for row in self._xx]
        for i in range(_FEATURES):
            a[i][i] += _RIDGE * (a[i][i] or 1.0)
        solved = _solve(a, self._xy[:])
        if solved is None:
            return None
        base, per_token, per_context = (max(value, 0.0) for value in solved)
        return StepCost(base, per_token, per_context)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out
