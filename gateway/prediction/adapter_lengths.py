"""The length predictor per LoRA adapter: a correction of the base model's prediction learnt from
the adapter's served traffic.

A fine-tune changes how long its answers are (one tuned to be thorough answers twice as long as
its base on the same prompts), while the length predictor is the base model's, trained on the
base's answers: routing and admission would plan every answer of such an adapter at half its
length. Training a predictor per adapter needs thousands of its answers and a retrain each; a
fine-tune mostly stretches or shrinks the base's lengths, which one factor captures from a few
dozen answers. So per adapter the gateway keeps its last `window` answers that ended on their own
(finish_reason "stop": one cut at max_tokens only bounds its length from below) with the base's
prediction for each, and scales the base's predicted length distribution by

    ratio = sum(actual tokens) / sum(base predicted tokens)      (over the window)

once it holds `min_samples` answers; before that the base's prediction stands. A ratio of sums,
not a mean of ratios: short answers' ratios are noisy (1 token against 3 predicted is 0.33) and
would weigh as much as long ones'. Bounded to [1/MAX_RATIO, MAX_RATIO] so a burst of odd answers
cannot swing routing without limit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from gateway.prediction.service import Prediction

DEFAULT_MIN_SAMPLES = 20
DEFAULT_WINDOW = 256
MAX_RATIO = 8.0


@dataclass(frozen=True, slots=True)
class AdapterLengthStatus:
    samples: int
    # None until min_samples answers were seen (the base's prediction stands).
    ratio: float | None


class _Window:
    __slots__ = ("actual", "base", "pairs")

    def __init__(self, size: int) -> None:
        self.pairs: deque[tuple[int, int]] = deque(maxlen=size)
        self.base = 0
        self.actual = 0

    def add(self, base: int, actual: int) -> None:
        if len(self.pairs) == self.pairs.maxlen:
            old_base, old_actual = self.pairs[0]
            self.base -= old_base
            self.actual -= old_actual
        self.pairs.append((base, actual))
        self.base += base
        self.actual += actual


class AdapterLengths:
    """Per adapter: the served answers' ratio to the base's predictions (module docstring)."""

    def __init__(
        self, min_samples: int = DEFAULT_MIN_SAMPLES, window: int = DEFAULT_WINDOW
    ) -> None:
        if min_samples < 1 or window < min_samples:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        self._min_samples = min_samples
        self._window = window
        self._by_adapter: dict[str, _Window] = {}

    def observe(self, adapter: str, base_tokens: int, actual_tokens: int) -> None:
        """An answer of `adapter` that ended on its own after `actual_tokens`, for which the
        base predicted `base_tokens` (>= 1)."""
        if base_tokens < 1 or actual_tokens < 0:
            raise ValueError(f"base {base_tokens} must be >= 1 and actual {actual_tokens} >= 0")
        window = self._by_adapter.get(adapter)
        if window is None:
            window = self._by_adapter[adapter] = _Window(self._window)
        window.add(base_tokens, actual_tokens)

    def ratio(self, adapter: str) -> float | None:
        """Contract: sum(actual) / sum(base) over the adapter's window, bounded to
        [1/MAX_RATIO, MAX_RATIO]; None with fewer than min_samples answers."""
        window = self._by_adapter.get(adapter)
        if window is None or len(window.pairs) < self._min_samples:
            return None
        return min(MAX_RATIO, max(1 / MAX_RATIO, window.actual / window.base))

    def corrected(self, adapter: str, prediction: Prediction) -> Prediction:
        """Contract: the base's prediction with its expected length and its length
        distribution's bucket lengths scaled by the adapter's ratio; unchanged without one."""
        ratio = self.ratio(adapter)
        if ratio is None:
            return prediction
        return replace(
            prediction,
            tokens=max(1, round(prediction.tokens * ratio)),
            p90_tokens=max(1, round(prediction.p90_tokens * ratio)),
            representatives=tuple(length * ratio for length in prediction.representatives),
        )

    def status(self) -> dict[str, AdapterLengthStatus]:
        return {
            adapter: AdapterLengthStatus(len(window.pairs), self.ratio(adapter))
            for adapter, window in self._by_adapter.items()
        }
