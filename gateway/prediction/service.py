"""Response-length prediction at the gateway: micro-batched, hot-swappable, never in the way.

The prompts that arrive while a batch is being predicted are the next batch (up to `max_batch`;
`max_wait_s` > 0 waits that long for more after the first), predicted in one onnxruntime call
on a worker thread, so the event loop does not run the model for long. By default nothing
waits: a lone request is predicted at once, and under load batches form by themselves.

The prompt of a request the gateway serves alone (the caller says so), if short (at most
`inline_chars` characters) and the predictor is idle, is predicted on the event loop itself:
the hand-off to the worker thread and back costs about 0.1 ms, an eighth of the prediction, and
nobody waits on the loop meanwhile. Under load it would cost more than it saves: each prompt
would find the predictor idle and run alone, and batches would no longer form (at concurrency
32: 745 -> 520 req/s, bench/results/gateway_overhead/predictor_inline.md). About a millisecond on
the loop is what the tokenize pool allows one request as well.

Without a predictor, or if it fails on a batch, requests go on without a prediction (the
engines then plan with max_tokens): a prediction improves routing but is never a reason to
refuse work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# Up to ~1 ms of prediction on one core (32 BERT tokens or so; 128 characters: 1.2 ms with the
# weights out of the caches, 0.9 ms for 64): bench/results/gateway_overhead/predictor_inline.md.
INLINE_CHARS = 128


class LengthPredictionLike(Protocol):
    @property
    def bucket(self) -> int: ...

    @property
    def expected_tokens(self) -> float: ...

    @property
    def p90_tokens(self) -> int: ...

    @property
    def probabilities(self) -> tuple[float, ...]: ...


class PredictorLike(Protocol):
    @property
    def version(self) -> str: ...

    @property
    def bucket_representatives(self) -> tuple[float, ...]:
        """Each bucket's mean length (what `probabilities` weigh into the expected length)."""
        ...

    def predict_batch(self, prompts: list[str]) -> Sequence[LengthPredictionLike]: ...


@dataclass(frozen=True, slots=True)
class Prediction:
    tokens: int  # expected response length
    p90_tokens: int
    bucket: int
    version: str
    # The length distribution behind `tokens`: each bucket's probability and mean length (raw,
    # before the artifact's calibration); empty when the predictor gives none.
    probabilities: tuple[float, ...] = ()
    representatives: tuple[float, ...] = ()

    def within(self, max_tokens: int) -> int:
        """The expected length of the answer as it will be served, cut at `max_tokens`:
        E[min(L, max_tokens)] over the distribution, at the served scale (the calibration's
        ratio to the raw expectation). Capping the expectation instead, min(E[L], max_tokens),
        over-predicts every request whose max_tokens is below the longest answers (issue 32:
        the demo's TF-IDF predictor, trained on answers up to 1,024 tokens, served at 256:
        mean 213 predicted, 141 actual; on the labels' validation split at 256 tokens: mean
        219 capped against 160 cut and 159 true, MAE 66.6 against 54.5)."""
        pairs = tuple(zip(self.probabilities, self.representatives, strict=False))
        full = sum(p * length for p, length in pairs)
        if len(self.probabilities) != len(self.representatives) or not pairs or full <= 0:
            return max(1, min(self.tokens, max_tokens))
        cut = sum(p * min(length, max_tokens) for p, length in pairs)
        return max(1, min(max_tokens, round(cut * self.tokens / full)))


@dataclass(frozen=True, slots=True)
class PredictorStatus:
    mode: str  # "active" or "fallback"
    version: str | None
    path: str | None
    predictions: int
    failures: int
    batch_p50_ms: float | None


@dataclass(slots=True)
class _Pending:
    prompt: str
    future: asyncio.Future[Prediction | None]


class PredictorService:
    def __init__(
        self,
        predictor: PredictorLike | None,
        *,
        path: str | None = None,
        loader: Callable[[Path], PredictorLike] | None = None,
        max_batch: int = 32,
        max_wait_s: float = 0.0,
        inline_chars: int = INLINE_CHARS,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._predictor = predictor
        # The runtime hands over the gateway's metrics after start_predictors built this service.
        self.metrics = metrics or GatewayMetrics()
        self._path = path
        self._loader = loader
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._inline_chars = inline_chars
        self._waiting: deque[_Pending] = deque()
        self._batch_running = False
        # Resolved when a prompt arrives for a runner that has none.
        self._arrived: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._predictions = 0
        self._failures = 0
        self._batch_ms: deque[float] = deque(maxlen=256)

    @property
    def version(self) -> str | None:
        return self._predictor.version if self._predictor is not None else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="length-predictor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def predict(self, prompt: str, *, alone: bool = False) -> Prediction | None:
        """The prompt's predicted length, None without a predictor or if it failed. `alone`:
        no other request is in flight at the gateway (the prompt may be predicted inline)."""
        if self._predictor is None or self._task is None:
            self.metrics.prediction_fallbacks.labels("no_predictor").inc()
            return None
        started = time.perf_counter()
        inline = alone and len(prompt) <= self._inline_chars
        if inline and not self._waiting and not self._batch_running:
            outcome = _run_batch(self._predictor, [prompt])
            self._account(outcome)
            result = outcome.results[0]
        else:
            future: asyncio.Future[Prediction | None] = asyncio.get_running_loop().create_future()
            self._waiting.append(_Pending(prompt, future))
            if self._arrived is not None and not self._arrived.done():
                self._arrived.set_result(None)
            result = await future
        self.metrics.prediction_seconds.observe(time.perf_counter() - started)
        if result is None:
            self.metrics.prediction_fallbacks.labels("error").inc()
        return result

    async def swap(self, path: Path) -> str:
        """Loads another artifact off the event loop, then serves it; raises if it is bad."""
        if self._loader is None:
            raise RuntimeError("this gateway was started without a predictor loader")
        predictor = await asyncio.to_thread(self._loader, path)
        previous = self.version
        self._predictor, self._path = predictor, str(path)
        log.info("length predictor %s -> %s (%s)", previous, predictor.version, path)
        return predictor.version

    def status(self) -> PredictorStatus:
        ordered = sorted(self._batch_ms)
        return PredictorStatus(
            mode="active" if self._predictor is not None else "fallback",
            version=self.version,
            path=self._path,
            predictions=self._predictions,
            failures=self._failures,
            batch_p50_ms=ordered[len(ordered) // 2] if ordered else None,
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting:
                self._arrived = loop.create_future()
                await self._arrived
            if self._max_wait_s > 0 and len(self._waiting) < self._max_batch:
                await asyncio.sleep(self._max_wait_s)
            count = min(len(self._waiting), self._max_batch)
            await self._predict([self._waiting.popleft() for _ in range(count)])

    async def _predict(self, batch: list[_Pending]) -> None:
        predictor = self._predictor
        results: list[Prediction | None] = [None] * len(batch)
        if predictor is not None:
            self._batch_running = True
            try:
                outcome = await asyncio.to_thread(_run_batch, predictor, [p.prompt for p in batch])
            finally:
                self._batch_running = False
            self._account(outcome)
            results = outcome.results
        for pending, result in zip(batch, results, strict=True):
            if not pending.future.done():
                pending.future.set_result(result)

    def _account(self, outcome: _Outcome) -> None:
        if outcome.failed:
            self._failures += len(outcome.results)
        else:
            self._predictions += len(outcome.results)
        self._batch_ms.append(outcome.seconds * 1000)
        self.metrics.predictor_batch_seconds.observe(outcome.seconds)


@dataclass(frozen=True, slots=True)
class _Outcome:
    results: list[Prediction | None]
    failed: bool
    seconds: float


def _run_batch(predictor: PredictorLike, prompts: list[str]) -> _Outcome:
    """One onnxruntime call for `prompts`, on whichever thread calls it (it touches nothing of
    the service's); None for every prompt if the predictor fails."""
    started = time.perf_counter()
    try:
        raw = predictor.predict_batch(prompts)
        lengths = predictor.bucket_representatives
        results: list[Prediction | None] = [
            Prediction(
                max(1, round(r.expected_tokens)),
                r.p90_tokens,
                r.bucket,
                predictor.version,
                r.probabilities,
                lengths,
            )
            for r in raw
        ]
        failed = False
    except Exception:  # a broken predictor must not fail requests: they go on without
        log.exception("length prediction failed for a batch of %d", len(prompts))
        results, failed = [None] * len(prompts), True
    return _Outcome(results, failed, time.perf_counter() - started)
