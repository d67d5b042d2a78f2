"""Response-length prediction at the gateway: micro-batched, hot-swappable, never in the way.

The prompts that arrive while a batch is being predicted are the next batch (up to `max_batch`;
`max_wait_s` > 0 waits that long for more after the first), predicted in one onnxruntime call
on a worker thread, so the event loop never runs the model. By default nothing waits: a lone
request is predicted at once, and under load batches form by themselves. Without a
predictor, or if it fails on a batch, requests go on without a prediction (the engines then plan
with max_tokens): a prediction improves routing but is never a reason to refuse work.
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


class LengthPredictionLike(Protocol):
    @property
    def bucket(self) -> int: ...

    @property
    def expected_tokens(self) -> float: ...

    @property
    def p90_tokens(self) -> int: ...


class PredictorLike(Protocol):
    @property
    def version(self) -> str: ...

    def predict_batch(self, prompts: list[str]) -> Sequence[LengthPredictionLike]: ...


@dataclass(frozen=True, slots=True)
class Prediction:
    tokens: int  # expected response length
    p90_tokens: int
    bucket: int
    version: str


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
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._predictor = predictor
        # The runtime hands over the gateway's metrics after start_predictors built this service.
        self.metrics = metrics or GatewayMetrics()
        self._path = path
        self._loader = loader
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._waiting: deque[_Pending] = deque()
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

    async def predict(self, prompt: str) -> Prediction | None:
        if self._predictor is None or self._task is None:
            self.metrics.prediction_fallbacks.labels("no_predictor").inc()
            return None
        started = time.perf_counter()
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
            started = time.perf_counter()
            try:
                raw = await asyncio.to_thread(predictor.predict_batch, [p.prompt for p in batch])
                results = [
                    Prediction(max(1, round(r.expected_tokens)), r.p90_tokens, r.bucket,
                               predictor.version)
                    for r in raw
                ]  # fmt: skip
                self._predictions += len(batch)
            except Exception:  # a broken predictor must not fail requests: they go on without
                log.exception("length prediction failed for a batch of %d", len(batch))
                self._failures += len(batch)
            self._batch_ms.append((time.perf_counter() - started) * 1000)
            self.metrics.predictor_batch_seconds.observe(self._batch_ms[-1] / 1000)
        for pending, result in zip(batch, results, strict=True):
            if not pending.future.done():
                pending.future.set_result(result)
